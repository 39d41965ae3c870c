"""The policy's weights, from the trainer's main process to a `grpo vllm-serve` server, a bucket at a time: the whole
model is never one blob on either side.

A bucket is consecutive (name, tensor) pairs of about `BUCKET_BYTES` (a larger tensor goes alone), laid end to end
in one flat uint8 buffer, with a JSON header saying where each tensor lies. Two transports carry the same buckets:

- collective (how TRL's vllm-serve and verl do it): a process group of two ranks, the trainer (rank 0, which
  hosts the rendezvous store on `vllm_group_port`, as TRL's client does) and the server (rank 1); NCCL when both
  sides are on CUDA devices, gloo otherwise (vLLM's CPU build, where the tests run it). Per bucket the trainer
  broadcasts the header's length, the header, then the buffer; a length of 0 ends the stream. The server receives
  each bucket into a fresh buffer and hands views of it to vLLM's `reload_weights`, which copies them into the
  engine's own.
- http (the fallback): the same buckets as one chunked POST body (8-byte header length, header, buffer), read
  by the server as it arrives.

torch's own process groups (`ProcessGroupGloo` / `ProcessGroupNCCL` over a `TCPStore`), built outside the default
group, so neither the trainer's process group nor vLLM's is touched, and the trainer needs no vLLM installed.
"""

from __future__ import annotations

import datetime
import json
import socket
import struct
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20  # verl's default bucket is 512 MiB (on GPUs); smaller keeps host memory flat on the CPU
ALIGN = 64  # every tensor starts at a multiple of this in its bucket, so a view of any dtype is aligned
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                      torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def _aligned(nbytes: int) -> int:
    """The bytes a tensor of `nbytes` takes in a bucket: rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def _buffer_size(header: bytes) -> int:
    """The bytes of the buffer a bucket's header describes."""
    return sum(_aligned(e["nbytes"]) for e in json.loads(header))


def buckets(weights: Iterable[tuple[str, torch.Tensor]], limit: int | None = None
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `weights` whose sizes add up to at most `limit` bytes (default `BUCKET_BYTES`; a
    larger tensor alone)."""
    limit = limit or BUCKET_BYTES
    group, size = [], 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if group and size + nbytes > limit:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += _aligned(nbytes)
    if group:
        yield group


def pack(group: list[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype | None = None
         ) -> tuple[bytes, torch.Tensor]:
    """(JSON header, flat uint8 buffer on `device`) of one bucket; floating tensors cast to `dtype` when given."""
    entries, offset = [], 0
    tensors = []
    for name, tensor in group:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
                        "offset": offset, "nbytes": nbytes})
        tensors.append(tensor)
        offset += _aligned(nbytes)
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for entry, tensor in zip(entries, tensors):
        # (reinterpreting the bytes: any dtype, bfloat16 included, travels as uint8)
        flat[entry["offset"]:entry["offset"] + entry["nbytes"]].copy_(
            tensor.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
    return json.dumps(entries).encode(), flat


def unpack(header: bytes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a bucket's buffer that `header` describes."""
    out = []
    for entry in json.loads(header):
        piece = flat[entry["offset"]:entry["offset"] + entry["nbytes"]]
        out.append((entry["name"], piece.view(DTYPES[entry["dtype"]]).view(entry["shape"])))
    return out


class HostCopy:
    """A copy of the policy's weights in host memory, taken on the trainer's path and pushed later by a thread
    (grpo.training.rollout.pipeline_server), while the update changes the weights themselves. Floating tensors are
    kept in the engine's `dtype` (what the push sends anyway). The buffers are kept and reused from push to push
    (one version in host memory), pinned when the weights are on a GPU, so each copy off the device is
    asynchronous and `take` waits once, for all of them."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def take(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
             ) -> list[tuple[str, torch.Tensor]]:
        copies, devices = [], set()
        for name, tensor in weights:
            tensor = tensor.detach()
            want = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            buffer = self.buffers.get(name)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != want:
                buffer = self.buffers[name] = torch.empty(tensor.shape, dtype=want, pin_memory=tensor.is_cuda)
            buffer.copy_(tensor, non_blocking=tensor.is_cuda)  # (a gathered temporary: its stream orders the reuse)
            if tensor.is_cuda:
                devices.add(tensor.device)
            copies.append((name, buffer))
        for device in devices:  # (one wait per device: every copy has landed before a thread reads the buffers)
            torch.cuda.current_stream(device).synchronize()
        return copies


# ---- collective ------------------------------------------------------------------------------------------------

def device_uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA device (the same GPU under any CUDA_VISIBLE_DEVICES numbering), else None."""
    device = torch.device(device)
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None


def open_group(host: str, port: int, rank: int, backend: str, timeout: float = 600.0) -> dist.ProcessGroup:
    """Rank `rank` (0: the trainer, 1: the server) of a two-rank group whose store the trainer hosts on
    `host`:`port`. `timeout` (vllm_server_timeout) bounds the store, and each collective: a server that died
    mid-push ends the trainer's wait then, not at torch's default of 10 minutes."""
    wait = datetime.timedelta(seconds=timeout)
    store = dist.PrefixStore("grpo-weights", dist.TCPStore(host, port, 2, is_master=rank == 0, timeout=wait))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, 2, wait)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, wait)
    raise ValueError(f"weight transfer backend {backend!r}: use nccl or gloo")


def close_group(group) -> None:
    """Shut a weight-transfer group down (NCCL's communicator holds device memory and a watchdog thread until
    then); a group already gone is left as it is."""
    try:
        group.shutdown()
    except (RuntimeError, AttributeError):
        pass


def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host` (the one the server can reach the trainer's store at)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # (UDP: no packet is sent; the kernel only picks the route)
        return probe.getsockname()[0]


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    _start(group, tensor).wait()


def send_weights(group: dist.ProcessGroup, weights, device: torch.device, dtype: torch.dtype | None = None,
                 limit: int | None = None) -> int:
    """Broadcast `weights` bucket by bucket from rank 0; returns the bytes sent."""
    sent, failed = fan_out([group], weights, device, dtype, limit)
    if failed:
        raise failed[0]
    return sent


def fan_out(groups: list[dist.ProcessGroup], weights, device: torch.device, dtype: torch.dtype | None = None,
            limit: int | None = None) -> tuple[int, dict[int, Exception]]:
    """Broadcast `weights` bucket by bucket from rank 0 of each group (one group per server): each bucket is packed
    once and its broadcasts on every group are issued before any is waited on (NCCL runs each communicator on its
    own stream, so the servers receive side by side). A group whose broadcast fails is left out from then on.
    Returns the bytes sent to each server, and the failures by group index."""
    sent, failed = 0, {}
    live = dict(enumerate(groups))
    for bucket in buckets(weights, limit):
        header, flat = pack(bucket, device, dtype)
        length = torch.tensor([len(header)], dtype=torch.int64, device=device)
        header = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        _each(live, failed, (length, header, flat))
        sent += flat.numel()
    _each(live, failed, (torch.zeros(1, dtype=torch.int64, device=device),))
    return sent, failed


def _each(live: dict, failed: dict, tensors: tuple) -> None:
    """Broadcast `tensors` in order on every live group, all issued before any is waited on; a failed group moves
    from `live` to `failed`."""
    works = {}
    for i, group in list(live.items()):
        try:
            works[i] = [_start(group, tensor) for tensor in tensors]
        except RuntimeError as err:  # (gloo raises at once on a peer gone)
            failed[i] = err
            del live[i]
    for i, pending in works.items():
        try:
            for work in pending:
                work.wait()
        except RuntimeError as err:  # (a peer gone; a timeout: vllm_server_timeout)
            failed[i] = err
            live.pop(i, None)


def _start(group: dist.ProcessGroup, tensor: torch.Tensor):
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


def receive_weights(group: dist.ProcessGroup, device: torch.device, to_host: bool = False
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs rank 0 sends, each bucket received only when the last one's tensors are taken
    (`to_host`: each bucket copied to the host in one piece, views of that copy)."""
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        _broadcast(group, length)
        if int(length) == 0:
            return
        header = torch.empty(int(length), dtype=torch.uint8, device=device)
        _broadcast(group, header)
        header = bytes(header.cpu().numpy())
        flat = torch.empty(_buffer_size(header), dtype=torch.uint8, device=device)
        _broadcast(group, flat)
        yield from unpack(header, flat.cpu() if to_host else flat)


# ---- http ------------------------------------------------------------------------------------------------------

def http_body(weights, dtype: torch.dtype | None = None, limit: int | None = None,
              piece: int = 16 << 20) -> Iterator[bytes]:
    """The chunks of a POST body carrying `weights`: per bucket its header's length (8 bytes, little-endian), the
    header and the buffer (in pieces of `piece` bytes); a length of 0 ends it."""
    for bucket in buckets(weights, limit):
        header, flat = pack(bucket, torch.device("cpu"), dtype)
        yield struct.pack("<q", len(header)) + header
        data = flat.numpy()
        for start in range(0, len(data), piece):
            yield data[start:start + piece].tobytes()
    yield struct.pack("<q", 0)


class ChunkedReader:
    """Reads the payload of an HTTP/1.1 chunked request body from `stream` (http.server does not decode it)."""

    def __init__(self, stream):
        self.stream, self.left, self.done = stream, 0, False

    def read_exactly(self, n: int) -> bytearray:
        out = bytearray(n)
        view, got = memoryview(out), 0
        while got < n:
            if self.left == 0:
                size = int(self.stream.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    raise ConnectionError(f"weights stream ended {n - got} bytes early")
                self.left = size
            take = min(self.left, n - got)
            read = self.stream.readinto(view[got:got + take])
            if not read:
                raise ConnectionError("weights stream closed early")
            got, self.left = got + read, self.left - read
            if self.left == 0:
                self.stream.readline()  # the CRLF after a chunk
        return out

    def finish(self) -> None:
        """Read what is left of the body (the last chunk and its trailer)."""
        while self.stream.readline() not in (b"\r\n", b"\n", b""):
            pass


def read_http_weights(reader: ChunkedReader) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of an `http_body`, a bucket read only when the last one's tensors are taken."""
    while True:
        (length,) = struct.unpack("<q", bytes(reader.read_exactly(8)))
        if length == 0:
            return
        header = bytes(reader.read_exactly(length))
        yield from unpack(header, torch.frombuffer(reader.read_exactly(_buffer_size(header)), dtype=torch.uint8))
