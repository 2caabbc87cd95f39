"""Load models and tokenizers by local path (or from the local Hugging Face cache), never from the hub.

* :func:`resolve_model_path` turns ``path_or_id`` into a local directory that holds a
  ``config.json``:

  - an existing directory is used as is (no ``config.json`` -> ``FileNotFoundError`` naming it);
  - something that looks like a local path (starts with ``/``, ``.`` or ``~``, or contains a path
    separator without being a single ``org/name``) and does not exist -> ``FileNotFoundError``
    naming the path;
  - anything else is treated as a hub id (``org/name`` or ``name``) and looked up in the local HF
    cache only (``local_files_only=True``, i.e. ``HF_HUB_OFFLINE`` semantics). If it is not cached,
    ``FileNotFoundError`` explains that the hub is unreachable from this machine and how to
    prefetch it on a connected host (``huggingface-cli download ORG/NAME``, then copy the cache /
    the snapshot directory over).

* :func:`load_model` loads with ``AutoModelForCausalLM`` in the requested dtype
  (``bf16``/``fp16``/``fp32``) and attention implementation (``eager``/``sdpa``, or vLLM's own kernels
  ``vllm_cpu``/``vllm_flash``: loaded eager, then switched to the registered bridge), in eval mode.
  ``model.generation_config`` is whatever the checkpoint ships; the tiny models from
  :mod:`roundalign.models.tiny` ship ``top_k=0, top_p=1.0, temperature=1.0`` (see there for why).

* :func:`load_tokenizer`: transformers 5.x maps a saved ``qwen2``/``qwen3`` directory to
  ``Qwen2Tokenizer`` through ``AutoTokenizer``, which rebuilds the pre-tokenizer/decoder from its
  own defaults. For the locally built tiny tokenizers (``roundalign_tiny.json`` present) we load
  ``tokenizer.json`` verbatim with ``PreTrainedTokenizerFast.from_pretrained``; everything else
  goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import torch
from huggingface_hub import constants, snapshot_download
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from roundalign.bridge import vllm_flash
from roundalign.engine.choices import ATTN_IMPLS  # eager, sdpa, vllm_cpu, vllm_flash
from roundalign.numerics.families import FAMILIES, not_aligned_yet
from roundalign.numerics.patch import apply_alignment, recorded_alignment

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def vllm_dtype(name: str) -> str:
    """vLLM's ``dtype=`` for one of :data:`DTYPES`' names ("bfloat16", "float16", "float32")."""
    return str(DTYPES[name]).removeprefix("torch.")

TINY_META_FILE = "roundalign_tiny.json"  # kept in sync with roundalign.models.tiny.META_FILE

# A hub repo id: "name" or "org/name" (letters, digits, '-', '_', '.'; no leading '.' / '-').
_HUB_ID_RE = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _looks_local(s: str) -> bool:
    if s.startswith(("/", ".", "~")):
        return True
    seps = {os.sep} | ({os.altsep} if os.altsep else set())
    return any(sep in s for sep in seps) and not _HUB_ID_RE.fullmatch(s)


# the model types of the families the alignment has (numerics/families.py); Qwen2.5 checkpoints are model_type qwen2
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


class ModelConfigError(ValueError):
    """A model directory's config.json is unreadable, of an unsupported architecture, or inconsistent."""


def check_model_config(config_file: str | os.PathLike) -> dict:
    """Read a model's ``config.json`` and check what roundalign needs of it, before any weight is loaded: valid
    JSON, the ``model_type`` of a family the alignment has (``numerics/families.py``), and attention dimensions that
    fit together. Raises :class:`ModelConfigError` with one line naming the file and the problem."""
    f = Path(config_file)
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{f} is not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{f} holds a JSON {type(cfg).__name__}, not a model config object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(f"{f}: model_type {mt!r} is not supported; roundalign aligns "
                               f"{'/'.join(SUPPORTED_MODEL_TYPES)} models only ("
                               + "; ".join(fam.note for fam in FAMILIES.values() if fam.note) + ")"
                               + not_aligned_yet(model_type=mt))
    dims = {k: cfg.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "num_hidden_layers", "vocab_size")}
    bad = [k for k, v in dims.items() if v is not None and (not isinstance(v, int) or v <= 0)]
    if bad:
        raise ModelConfigError(f"{f}: {', '.join(f'{k}={dims[k]!r}' for k in bad)} must be positive integers")
    h, nh = dims["hidden_size"], dims["num_attention_heads"]
    kv = dims["num_key_value_heads"] or nh  # absent: every head its own KV head
    if h and nh and cfg.get("head_dim") is None and h % nh:
        raise ModelConfigError(f"{f}: hidden_size={h} is not divisible by num_attention_heads={nh} "
                               "(and no head_dim is given)")
    if nh and kv and nh % kv:
        raise ModelConfigError(f"{f}: num_attention_heads={nh} is not a multiple of num_key_value_heads={kv}")
    return cfg


def _check_model_dir(d: Path, shown: str) -> str:
    if not d.is_dir():
        raise FileNotFoundError(f"model path {shown!r} exists but is not a directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(
            f"model directory {str(d)!r} has no config.json; it is not a saved model "
            "(build one with roundalign.models.tiny.make_tiny or point at a downloaded snapshot)"
        )
    check_model_config(d / "config.json")
    return str(d)


def resolve_model_path(path_or_id: str) -> str:
    """Return a local directory (with ``config.json``) for ``path_or_id``; never touches the network."""
    s = os.fspath(path_or_id)
    if not isinstance(s, str) or not s.strip():
        raise ValueError(f"model path or hub id must be a non-empty string, got {path_or_id!r}")
    p = Path(s).expanduser()
    if p.exists():
        return _check_model_dir(p, s)
    if _looks_local(s) or not _HUB_ID_RE.fullmatch(s):
        raise FileNotFoundError(f"model path {s!r} does not exist")

    try:
        snap = snapshot_download(repo_id=s, local_files_only=True)
    except Exception as e:  # LocalEntryNotFoundError, HFValidationError, ...
        raise FileNotFoundError(
            f"model {s!r} is neither a local directory nor in the local Hugging Face cache "
            f"({_hf_cache_dir()}), and the hub is unreachable from this machine. Prefetch it on a "
            f"connected host with `huggingface-cli download {s}` (or `hf download {s}`) and copy the "
            "cache (HF_HOME / HF_HUB_CACHE) or the snapshot directory here, then pass its path. "
            f"[{type(e).__name__}: {e}]"
        ) from e
    return _check_model_dir(Path(snap), s)


def _hf_cache_dir() -> str:
    try:
        return str(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - a huggingface_hub without HF_HUB_CACHE
        return "HF_HUB_CACHE"


def load_model(path_or_id: str, dtype: str = "bf16", attn: str = "eager"):
    """Load a causal LM from a local directory / the local HF cache, in ``dtype``, in eval mode."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid choices: {', '.join(DTYPES)}")
    if attn not in ATTN_IMPLS:
        raise ValueError(f"unknown attn {attn!r}; valid choices: {', '.join(ATTN_IMPLS)}")
    path = resolve_model_path(path_or_id)

    _check_weight_shapes(Path(path))
    bridged = attn in ("vllm_cpu", "vllm_flash")  # vLLM's own kernels: loaded eager, then switched to them
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=DTYPES[dtype], attn_implementation="eager" if bridged else attn, local_files_only=True
    )
    if attn == "vllm_cpu":  # vLLM's CPU kernel (forward) with SDPA's gradient; registered here, then switched to
        from roundalign.bridge import vllm_cpu_attention  # noqa: PLC0415 -- lazy: requests AMX (bridge.vllm_cpu)

        vllm_cpu_attention.register()
        model.set_attn_implementation("vllm_cpu")
    elif attn == "vllm_flash":  # vLLM's CUDA FlashAttention call (forward) with SDPA's gradient, likewise; registered
        # with transformers as "vllm_fa" (a name with "flash" in it is taken for flash-attn)
        vllm_flash.register()
        model.set_attn_implementation(vllm_flash.HF_ATTN_NAME)
    model.eval()
    rec = recorded_alignment(model.config)
    if rec is not None:  # saved from an aligned model: a plain from_pretrained would silently give stock numerics
        print(f"[roundalign] {path}: re-applying the recorded alignment variant={rec[0]} engine={rec[1]} "
              f"kernels={rec[2]}", flush=True)
        orders = getattr(model.config, "roundalign", {}).get("norm_sum_orders")
        apply_alignment(model, *rec, norm_sum_orders=orders)
    return model


def weights_fingerprint(path_or_id: str) -> str:
    """A short content fingerprint of a model directory, cheap at any size: sha256 over config.json and, per
    safetensors file, its name, size, header and the first and last 64 KiB of its data. A run records it
    (run.json ``model_fingerprint``) so that rerunning into the same --out after the model at that path was
    rebuilt (a new warm start, say) is refused instead of silently taking the old run as done."""
    d = Path(resolve_model_path(path_or_id))
    h = hashlib.sha256((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f"{f.name}:{size}".encode())
            h.update(head + fh.read(min(n, size) + 65536))
            fh.seek(max(0, size - 65536))
            h.update(fh.read())
    return h.hexdigest()[:16]


def _check_weight_shapes(d: Path) -> None:
    """Compare the tensor shapes in the directory's safetensors headers (no tensor is read) with the shapes its
    config.json implies (the model built on the meta device); one line naming the first tensor that disagrees,
    where transformers would print its whole load report and an error about ``ignore_mismatched_sizes``."""
    files = sorted(d.glob("*.safetensors"))
    if not files:
        return
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(d, local_files_only=True)).state_dict().items()}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                shape = tuple(st.get_slice(key).get_shape())
                if key in expected and expected[key] != shape:
                    raise ModelConfigError(f"{f}: tensor {key} has shape {list(shape)}, but {d / 'config.json'} "
                                           f"implies {list(expected[key])}: the weights and the config disagree")


def load_tokenizer(path_or_id: str):
    """Load the tokenizer saved next to a model (verbatim ``tokenizer.json`` for tiny models)."""
    path = resolve_model_path(path_or_id)
    if (Path(path) / TINY_META_FILE).is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
