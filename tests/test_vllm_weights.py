"""The bucketed weight stream of server mode (grpo/engines/vllm_weights.py), without a server: buckets, and the
same tensors out of a gloo group and out of a chunked HTTP body as went in (tests/test_vllm_server.py runs both
against a real vLLM server)."""

from __future__ import annotations

import io
import socket
import threading

import torch

from grpo.engines import vllm_weights


def weights():
    gen = torch.Generator().manual_seed(0)
    return [("a.weight", torch.randn(7, 5, generator=gen)),  # 140 bytes
            ("b.weight", torch.randn(3, generator=gen).to(torch.bfloat16)),
            ("big.weight", torch.randn(40, 30, generator=gen)),  # 4800 bytes: over the limit, alone
            ("count", torch.tensor([3, 1, 4], dtype=torch.int64)),
            ("c.bias", torch.randn(2, 2, generator=gen)[:, 0])]  # not contiguous


def assert_same(got, want, dtype=None):
    assert [name for name, _ in got] == [name for name, _ in want]
    for (_, a), (_, b) in zip(got, want):
        b = b.to(dtype) if dtype is not None and b.is_floating_point() else b
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_buckets_hold_at_most_the_limit_and_a_larger_tensor_alone():
    # sizes rounded up to 64 bytes: a 192, b 64, big 4800, count 64, c 64
    groups = [[name for name, _ in g] for g in vllm_weights.buckets(weights(), limit=256)]
    assert groups == [["a.weight", "b.weight"], ["big.weight"], ["count", "c.bias"]]


def test_weights_cross_a_gloo_group_bucket_by_bucket():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    received = {}

    def server():
        group = vllm_weights.open_group("127.0.0.1", port, 1, "gloo", timeout=60)
        received["weights"] = [(n, t.clone()) for n, t in vllm_weights.receive_weights(group, torch.device("cpu"))]

    thread = threading.Thread(target=server)
    thread.start()
    group = vllm_weights.open_group("127.0.0.1", port, 0, "gloo", timeout=60)
    sent = vllm_weights.send_weights(group, iter(weights()), torch.device("cpu"), limit=256)
    thread.join(60)
    assert_same(received["weights"], weights())
    assert sent == 192 + 64 + 4800 + 64 + 64


def test_weights_cross_a_chunked_http_body_cast_to_the_engines_dtype():
    body = io.BytesIO()
    for chunk in vllm_weights.http_body(weights(), dtype=torch.bfloat16, limit=256, piece=100):
        body.write(b"%X\r\n" % len(chunk) + chunk + b"\r\n")  # as http.client's encode_chunked writes it
    body.write(b"0\r\n\r\nnext request")
    body.seek(0)
    reader = vllm_weights.ChunkedReader(body)
    assert_same(list(vllm_weights.read_http_weights(reader)), weights(), torch.bfloat16)
    reader.finish()
    assert body.read() == b"next request"  # the whole body, and nothing after it, was read
