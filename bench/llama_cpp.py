"""llama.cpp beside our engine in `bench/engine_vs_hf.py` (`--llama-cpp`): another engine with
its own CPU kernels, continuous batching and KV cache, built here from PyPI.

llama.cpp itself comes from the `llama-cpp-python` sdist on PyPI (it vendors the whole
llama.cpp tree: the C++ sources, `convert_hf_to_gguf.py`, `gguf-py`): downloaded once,
`llama-batched-bench` built once with CMake (a few minutes on 2 cores), both cached under
`~/.cache/elastic-moe/llama.cpp/<version>/`.

The checkpoint transformers saved is converted to GGUF at f32 (the same weights and
arithmetic width as every other side). The converter needs a tokenizer and the bench's
checkpoint has none (every side feeds token ids): a SentencePiece model is trained here on a
few lines of text (`sentencepiece`, installed into the cache) and the converter pads its
vocabulary to the model's with unused tokens, which no side ever emits or reads.

`llama-batched-bench -npp P -ntg N-1 -npl S` runs S sequences of P prompt tokens each, all
prefilled, then N - 1 decode steps of all S together (one `llama_decode` a step, its KV
cache, no sampling: the next inputs are random tokens), and prints the prefill and decode
times; `run` turns each row into the bench's columns: tokens/s = S x N tokens (the prefill
gives each stream its first, as on every other side) over the whole time, TTFT = the
prefill time of all S prompts (every stream's first token comes after it), inter-token =
the decode time a step.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tarfile
import time
from typing import Any

VERSION = "0.3.36"
CACHE = pathlib.Path(os.environ.get("MOE_CACHE", pathlib.Path.home() / ".cache/elastic-moe"))
ROW = re.compile(
    r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6
)
TEXT = """The quick brown fox jumps over the lazy dog.
Elastic expert parallelism resizes a live deployment while it serves.
A mixture of experts routes every token to a few of its experts.
Pack my box with five dozen liquor jugs.
"""


def _log(message: str) -> None:
    print(f"[llama.cpp] {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str], *, what: str, **kwargs: Any) -> None:
    started = time.monotonic()
    _log(f"{what}: {' '.join(cmd[:4])} ...")
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
    _log(f"{what}: done in {time.monotonic() - started:.0f}s")


def build(cache: pathlib.Path = CACHE) -> pathlib.Path:
    """The llama.cpp source tree with `build/bin/llama-batched-bench` built (cached)."""
    root = cache / "llama.cpp" / VERSION
    tree = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    binary = tree / "build" / "bin" / "llama-batched-bench"
    if binary.is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.is_file():
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(root)],
            what="downloading the llama-cpp-python sdist from PyPI (~75 MB)",
        )  # fmt: skip
    if not tree.is_dir():
        with tarfile.open(sdist) as tar:
            tar.extractall(root, filter="data")
    _run(
        ["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
         "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"],
        what="configuring llama.cpp",
        cwd=tree,
    )  # fmt: skip
    _run(
        ["cmake", "--build", "build", "--target", "llama-batched-bench", "-j", str(os.cpu_count())],
        what="building llama-batched-bench (a few minutes on 2 cores)",
        cwd=tree,
    )
    return tree


def _python_deps(cache: pathlib.Path) -> pathlib.Path:
    """A folder holding `sentencepiece` (the converter's and the tokenizer's), on sys.path."""
    target = cache / "llama.cpp" / VERSION / "pydeps"
    if not (target / "sentencepiece").is_dir():
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--target",
                str(target),
                "sentencepiece",
            ],
            what="installing sentencepiece for the converter",
        )
    return target


def to_gguf(
    checkpoint: pathlib.Path, tree: pathlib.Path, cache: pathlib.Path = CACHE
) -> pathlib.Path:
    """`checkpoint` (a transformers save) as an f32 GGUF file beside it, with a tokenizer."""
    out = checkpoint / "model-f32.gguf"
    if out.is_file():
        return out
    deps = _python_deps(cache)
    sys.path.insert(0, str(deps))
    import sentencepiece

    text = checkpoint / "tokenizer-text.txt"
    text.write_text(TEXT * 50)
    sentencepiece.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(checkpoint / "tokenizer"),
        vocab_size=200,
        model_type="bpe",
        minloglevel=2,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(deps), str(tree / "gguf-py")]))
    _run(
        [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(checkpoint), "--outtype", "f32",
         "--outfile", str(out)],
        what="converting the checkpoint to GGUF (f32)",
        env=env,
    )  # fmt: skip
    return out


def run(
    tree: pathlib.Path,
    gguf: pathlib.Path,
    streams: list[int],
    prompt_len: int,
    new: int,
    threads: int,
) -> dict[int, dict[str, Any]]:
    """`llama-batched-bench` at each stream count -> {streams: the bench's row fields}."""
    ctx = max(streams) * (prompt_len + new) + 64
    cmd = [
        str(tree / "build" / "bin" / "llama-batched-bench"), "-m", str(gguf), "-c", str(ctx),
        "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(new - 1),
        "-npl", ",".join(str(s) for s in streams), "-t", str(threads), "-tb", str(threads),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-batched-bench failed:\n{(done.stdout + done.stderr)[-3000:]}")
    rows: dict[int, dict[str, Any]] = {}
    for line in (done.stdout + done.stderr).splitlines():
        m = ROW.match(line.strip())
        if not m:
            continue
        _pp, tg, b, _kv = (int(m.group(i)) for i in range(1, 5))
        t_pp, _s_pp, t_tg, _s_tg, t, _s = (float(m.group(i)) for i in range(5, 11))
        gap = t_tg / max(1, tg)
        rows[b] = {
            "tok/s": b * (tg + 1) / t,
            "ttft": (t_pp, t_pp),
            "itl": (gap, gap),
            "wall": t,
        }
    missing = [s for s in streams if s not in rows]
    if missing:
        raise RuntimeError(f"llama-batched-bench printed no row for {missing} streams")
    return rows
