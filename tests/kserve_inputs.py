"""Inputs of berth's KServe v2 models, as the stock client (tritonclient) sends.

Only for tests that import tritonclient's own `inference` stubs, never
berth's (services.proto.inference): one process can hold only one of them.
"""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as triton


def text_input(texts: list[str]) -> triton.InferInput:
    tensor = triton.InferInput("TEXT", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object))
    return tensor
