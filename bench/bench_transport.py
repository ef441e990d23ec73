"""Loopback throughput of the blob protocol against a raw libp2p stream, TLS and plain TCP.

Each transport moves the same N MiB from a server process to this process: SwarmHost's blob
protocol (fetch_blob: disk writes and the final sha256 check included), a bare py-libp2p stream
with Noise + Yamux as the library builds them (1 MiB writes, read into memory), Python's `ssl`
over TCP (a self-signed certificate made on the fly) and plain TCP. Rounds run every transport
once, so a busy machine slows all of them alike. Prints the median MiB/s, the CPU time per MiB
(client + server processes), and the ratios to TLS and of the blob to the raw stream.
Run: `python bench/bench_transport.py [--mib 64] [--rounds 5] [--only blob,raw,tls,tcp]
[--dir DIR]`.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import multiprocessing
import os
import socket
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MIB = 1 << 20
WRITE_BYTES = MIB
SERVER_TIMEOUT_S = 120
SERVER_STOP_TIMEOUT_S = 15
BENCH_TOPIC = "skillswarm-bench"
RAW_PROTOCOL_ID = "/skillswarm/bench-raw/1.0.0"
TRANSPORTS = ("blob", "raw", "tls", "tcp")
LABELS = {
    "blob": "(a) libp2p blob protocol, SwarmHost.fetch_blob",
    "raw": "    raw libp2p stream, stock Noise + Yamux",
    "tls": "(b) TLS, Python ssl over TCP",
    "tcp": "(c) plain TCP",
}


@dataclass(frozen=True)
class Transfer:
    """One transfer of the payload: wall seconds, and CPU seconds spent on each side."""

    seconds: float
    client_cpu_s: float
    server_cpu_s: float


# SwarmHost blob protocol (the client writes to disk and checks the sha256, as a node does)


def serve_blob_with_swarm_host(control: Connection, size: int, root: str) -> None:
    """Server process: a SwarmHost serving one random blob until told to stop."""
    from skillswarm.protocol.blobstore import BlobStore
    from skillswarm.protocol.host import SwarmHost, freeze_startup_heap
    from skillswarm.protocol.identity import load_or_create_identity

    freeze_startup_heap()  # as `skillswarm node run` and `coordinator serve` do
    store = BlobStore(Path(root) / "server-blobs")
    sha256 = store.put_bytes(os.urandom(size))
    host = SwarmHost(load_or_create_identity(Path(root) / "server.key"), store, BENCH_TOPIC)
    with host:
        host.serve_blob(sha256)
        control.send((host.listen_addrs[0], sha256))
        _report_cpu_between_marks(control)
        control.send(host.bytes_served)


def transfer_blob(size: int, root: Path) -> Transfer:
    from skillswarm.protocol.blobstore import BlobStore
    from skillswarm.protocol.checkpoint import sha256_of_file
    from skillswarm.protocol.host import SwarmHost, freeze_startup_heap
    from skillswarm.protocol.identity import load_or_create_identity

    freeze_startup_heap()  # in both processes: a full collection stalls the host's event loop
    control, server = _start_server(serve_blob_with_swarm_host, size, str(root))
    try:
        address, sha256 = control.recv()
        store = BlobStore(root / "client-blobs")
        store.delete(sha256)
        client = SwarmHost(load_or_create_identity(root / "client.key"), store, BENCH_TOPIC)
        with client:
            server_id = client.connect(address)
            with _measured(control) as measure:
                path = client.fetch_blob(server_id, sha256, size)
            assert sha256_of_file(path) == sha256
        assert control.recv() == size, "the server did not send exactly one blob"
    finally:
        _stop_server(server)
    return measure.result


# Raw libp2p stream: stock py-libp2p Noise + Yamux, 1 MiB writes, nothing written to disk


def _raw_libp2p_host(key_pair: Any) -> Any:
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
    from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
    from libp2p.security.noise.transport import Transport as NoiseTransport
    from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
    from libp2p.stream_muxer.yamux.yamux import Yamux

    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")],
    )


def serve_raw_libp2p(control: Connection, size: int) -> None:
    """Server process: a bare libp2p host that writes `size` bytes on every stream opened to it."""
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair

    payload = os.urandom(WRITE_BYTES)

    async def send_payload(stream: Any) -> None:
        remaining = size
        while remaining > 0:
            chunk = payload[: min(remaining, WRITE_BYTES)]
            await stream.write(chunk)
            remaining -= len(chunk)
        await stream.close()

    async def serve() -> None:
        host = _raw_libp2p_host(create_new_key_pair())
        host.set_stream_handler(RAW_PROTOCOL_ID, send_payload)
        async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            control.send(str(host.get_addrs()[0]))
            await trio.to_thread.run_sync(_report_cpu_between_marks, control)

    trio.run(serve)


def transfer_raw_libp2p(size: int, root: Path) -> Transfer:
    import multiaddr
    import trio
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.custom_types import TProtocol
    from libp2p.peer.peerinfo import info_from_p2p_addr

    control, server = _start_server(serve_raw_libp2p, size)
    try:
        peer_info = info_from_p2p_addr(multiaddr.Multiaddr(control.recv()))

        async def receive() -> Transfer:
            host = _raw_libp2p_host(create_new_key_pair())
            async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
                await host.connect(peer_info)
                with _measured(control) as measure:
                    stream = await host.new_stream(peer_info.peer_id, [TProtocol(RAW_PROTOCOL_ID)])
                    received = 0
                    while received < size:
                        received += len(await stream.read(WRITE_BYTES))
                assert received == size, f"raw stream ended after {received} of {size} bytes"
                await stream.close()
            return measure.result

        return trio.run(receive)
    finally:
        _stop_server(server)


# TLS and plain TCP (received into memory)


def make_self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate for 127.0.0.1 (P-256); returns (certificate, key) PEM paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    certificate_path, key_path = directory / "bench-cert.pem", directory / "bench-key.pem"
    certificate_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return certificate_path, key_path


def serve_socket(control: Connection, size: int, tls_files: tuple[str, str] | None) -> None:
    """Server process: accepts one connection and sends `size` bytes on it (over TLS if given)."""
    context = None
    if tls_files is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls_files)
    payload = os.urandom(WRITE_BYTES)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        control.send(listener.getsockname()[1])
        control.recv()  # the start mark
        started_cpu = time.process_time()
        connection, _ = listener.accept()
        if context is not None:
            connection = context.wrap_socket(connection, server_side=True)
        with connection:
            remaining = size
            while remaining > 0:
                chunk = payload[: min(remaining, WRITE_BYTES)]
                connection.sendall(chunk)
                remaining -= len(chunk)
        control.recv()  # the end mark
        control.send(time.process_time() - started_cpu)


def transfer_socket(size: int, tls_files: tuple[Path, Path] | None) -> Transfer:
    context = None
    if tls_files is not None:
        context = ssl.create_default_context(cafile=str(tls_files[0]))
    server_files = None if tls_files is None else (str(tls_files[0]), str(tls_files[1]))
    control, server = _start_server(serve_socket, size, server_files)
    try:
        port = control.recv()
        buffer = bytearray(WRITE_BYTES)
        with _measured(control, server_reports_start=False) as measure:
            connection = socket.create_connection(("127.0.0.1", port))
            if context is not None:
                connection = context.wrap_socket(connection, server_hostname="127.0.0.1")
            with connection:
                received = 0
                while count := connection.recv_into(buffer):
                    received += count
        assert received == size, f"connection ended after {received} of {size} bytes"
    finally:
        _stop_server(server)
    return measure.result


# Measuring


class _measured:
    """Times the block and collects both processes' CPU time over it (marks sent to the server)."""

    def __init__(self, control: Connection, server_reports_start: bool = True) -> None:
        self._control = control
        self._server_reports_start = server_reports_start
        self.result: Transfer

    def __enter__(self) -> _measured:
        self._control.send("start")
        if self._server_reports_start:
            self._server_cpu_start = self._control.recv()
        self._client_cpu_start = time.process_time()
        self._started = time.perf_counter()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        seconds = time.perf_counter() - self._started
        client_cpu = time.process_time() - self._client_cpu_start
        if exc_type is not None:
            return
        self._control.send("end")
        server_cpu = self._control.recv()
        if self._server_reports_start:
            server_cpu -= self._server_cpu_start
        self.result = Transfer(seconds, client_cpu, server_cpu)


def _report_cpu_between_marks(control: Connection) -> None:
    """Server side of _measured: answer the start and end marks with this process's CPU time."""
    for _ in ("start", "end"):
        control.recv()
        control.send(time.process_time())


def _start_server(
    target: Callable[..., None], *args: object
) -> tuple[Connection, multiprocessing.Process]:
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=target, args=(theirs, *args), daemon=True)
    server.start()
    if not ours.poll(SERVER_TIMEOUT_S):
        server.kill()
        raise RuntimeError(f"{target.__name__} did not start within {SERVER_TIMEOUT_S} s")
    return ours, server


def _stop_server(server: multiprocessing.Process) -> None:
    """Wait for a server process that finished its transfer; kill one left waiting by an error."""
    server.join(SERVER_STOP_TIMEOUT_S)
    if server.is_alive():
        server.kill()
        server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64, help="MiB moved per transfer")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; each runs every transport")
    parser.add_argument(
        "--only", default=",".join(TRANSPORTS), help=f"a subset of {','.join(TRANSPORTS)}"
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the blob stores go (default: the temp dir); a tmpfs such as /dev/shm takes "
        "the disk out of the blob's figure",
    )
    args = parser.parse_args()
    chosen = [name for name in TRANSPORTS if name in args.only.split(",")]
    if not chosen or not set(args.only.split(",")) <= set(TRANSPORTS):
        parser.error(f"--only takes a subset of {','.join(TRANSPORTS)}, got {args.only}")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    size = args.mib * MIB

    results: dict[str, list[Transfer]] = {name: [] for name in chosen}
    with tempfile.TemporaryDirectory(prefix="bench-transport-", dir=args.dir) as work:
        root = Path(work)
        certificate = make_self_signed_certificate(root)
        run: dict[str, Callable[[], Transfer]] = {
            "blob": lambda: transfer_blob(size, root),
            "raw": lambda: transfer_raw_libp2p(size, root),
            "tls": lambda: transfer_socket(size, certificate),
            "tcp": lambda: transfer_socket(size, None),
        }
        for _ in range(args.rounds):
            for name in chosen:
                results[name].append(run[name]())

    print(f"{args.mib} MiB over 127.0.0.1, server process -> this process, {args.rounds} rounds")
    if args.dir is not None:
        print(f"blob stores in {args.dir}")
    print(f"{'':50} {'MiB/s':>8} {'CPU ms/MiB':>11} {'(client':>8} {'server)':>8}")
    for name in chosen:
        transfers = results[name]
        rate = statistics.median(args.mib / t.seconds for t in transfers)
        client = statistics.median(1000 * t.client_cpu_s / args.mib for t in transfers)
        server = statistics.median(1000 * t.server_cpu_s / args.mib for t in transfers)
        print(f"{LABELS[name]:50} {rate:8.1f} {client + server:11.2f} {client:8.2f} {server:8.2f}")
    if "tls" in results:
        for name in ("blob", "raw"):
            if name in results:
                # Per round, so that both sides of a ratio saw the same machine load.
                ratios = [
                    tls.seconds / other.seconds
                    for other, tls in zip(results[name], results["tls"], strict=True)
                ]
                label = f"ratio {name} / TLS in MiB/s (target >= 0.4)"
                spread = f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
                print(f"{label:50} {statistics.median(ratios):8.2f}  {spread}")
    if "blob" in results and "raw" in results:
        # What the blob protocol keeps of a bare stream's rate (disk writes and sha256 included).
        ratios = [
            raw.seconds / blob.seconds
            for blob, raw in zip(results["blob"], results["raw"], strict=True)
        ]
        spread = f"(rounds {min(ratios):.2f}-{max(ratios):.2f})"
        label = "ratio blob / raw libp2p stream in MiB/s"
        print(f"{label:50} {statistics.median(ratios):8.2f}  {spread}")


if __name__ == "__main__":
    main()
