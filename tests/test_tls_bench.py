"""benchmarks/tls.py: the certificates it makes complete a mutual TLS
handshake (both key kinds), and a short run measures plaintext, TLS and
mutual TLS stacks at the same rates and writes the JSON with the ratios."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from pathlib import Path

from benchmarks.serving.certs import KEYS, make_pki
from tests.stack import ROOT


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> ssl.SSLObject:
    """A TLS handshake between the two in memory: the server's end."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    ends = {
        "client": (client.wrap_bio(to_client, to_server, server_hostname="127.0.0.1")),
        "server": server.wrap_bio(to_server, to_client, server_side=True),
    }
    done: set[str] = set()
    for _ in range(10):
        for name, end in ends.items():
            if name not in done:
                try:
                    end.do_handshake()
                    done.add(name)
                except ssl.SSLWantReadError:
                    pass
        if len(done) == 2:
            return ends["server"]
    raise AssertionError(f"handshake unfinished: {done}")


def test_the_certificates_complete_a_mutual_tls_handshake(tmp_path: Path) -> None:
    for kind in KEYS:
        folder = tmp_path / kind
        folder.mkdir()
        pki = make_pki(folder, kind)
        assert pki.serve_args("plaintext") == [] and pki.client("plaintext") is None
        flags = pki.serve_args("mtls")
        assert flags[::2] == ["--tls-cert", "--tls-key", "--tls-client-ca"]
        assert all(Path(f).exists() for f in flags[1::2])
        assert pki.serve_args("tls") == flags[:4]
        tls, mtls = pki.client("tls"), pki.client("mtls")
        assert tls is not None and tls.chain is None and tls.key is None
        assert mtls is not None and mtls.chain and mtls.key

        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(folder / "server.pem", folder / "server.key")
        server.load_verify_locations(folder / "ca.pem")
        server.verify_mode = ssl.CERT_REQUIRED
        client = ssl.create_default_context(cafile=folder / "ca.pem")
        client.load_cert_chain(folder / "client.pem", folder / "client.key")
        peer = handshake(server, client).getpeercert()
        assert peer and ("commonName", "berth benchmark client") in peer["subject"][0]


def test_a_short_run_measures_every_mode_at_the_same_rates(
    repository: Path, tmp_path: Path
) -> None:
    """One round, one short step. Each mode's clients dial with that mode's
    credentials (a TLS client gets no answer from a plaintext port, nor the
    other way round), so a run that finishes had each stack served as
    named; every mode's step runs at the rate set by plaintext's capacity."""
    out = tmp_path / "tls.json"
    done = subprocess.run(
        [
            *(sys.executable, "benchmarks/tls.py", "--out", str(out)),
            *("--model-repository", str(repository), "--rounds", "1"),
            *("--rates", "0.5", "--duration", "0.5", "--max-requests", "20"),
            *("--handshakes", "5", "--warmup-s", "0.2", "--probe-s", "0.5"),
            *("--probe-concurrency", "4"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "x plaintext" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "benchmarks/tls.py" and doc["machine"]["cores"] >= 1
    assert doc["certificates"].startswith("ECDSA P-256")
    modes = doc["modes"]
    assert list(modes) == ["plaintext", "tls", "mtls"]
    plain = modes["plaintext"]["capacity"]["throughput"]
    for mode in modes.values():
        setup = mode["connection_setup"]
        assert setup["channels"] == 5 and setup["first_call_p50_ms"] > 0, setup
        (cap,) = mode["capacity"]["by_round"]
        assert cap["ok"] > 0 and not cap["errors"], cap
        (step,) = mode["steps"]
        assert step["name"] == "0.5x" and step["rate"] == round(0.5 * plain, 1)
        assert step["sent"] == step["ok"] > 0 and step["errors"] == 0, step
        assert len(step["by_round"]) == 1
    assert set(doc["ratios_over_plaintext"]) == {"tls", "mtls"}
    for ratio in doc["ratios_over_plaintext"].values():
        assert ratio["capacity"] > 0 and ratio["first_call_p50"] > 0, ratio
        assert ratio["steps"]["0.5x"]["throughput"] > 0, ratio
