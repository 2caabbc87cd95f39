"""Tiny Qwen2 / Qwen3 checkpoints with realistic activation scales, built fully offline.

``make_tiny(arch, out_dir, ...)`` writes a directory that loads by path with
``AutoModelForCausalLM.from_pretrained`` (and with :func:`roundalign.models.load.load_model`), with vLLM
and with TRL: ``config.json``, ``model.safetensors`` (bf16), ``generation_config.json``,
``tokenizer.json`` / ``tokenizer_config.json`` / chat template, and ``roundalign_tiny.json`` (the
arguments used plus the resolved sizes).

Why not just ``AutoModelForCausalLM.from_config``?
--------------------------------------------------
The models exist to study bf16 rounding mismatch between a trainer and an inference engine. HF's
default init (``N(0, 0.02)`` Linear weights, unit RMSNorm weights, zero biases) gives activations
far smaller than a trained model's, and unit norm weights make the bf16 product ``weight * x``
exact, which hides exactly the rounding we want to see. So every parameter is overwritten:

* **Embeddings** ``N(0, 1)``: the residual stream starts at RMS ~1 like a real model's.
* **Linear weights** ``N(0, 1/fan_in)`` (std ``1/sqrt(fan_in)``): each projection preserves the
  RMS of its input, so attention / MLP outputs are O(1) per layer and the residual stream grows
  across layers (measured for the default 2-layer model: embeddings ~1.0, after layer 1 ~1.4,
  after layer 2 ~1.8; it keeps growing roughly like ``sqrt(1 + layers)``).
* **RMSNorm weights** (input, post-attention, final and Qwen3 ``q_norm`` / ``k_norm``) are
  lognormal around 1, ``exp(N(0, 0.3^2))``, so ``weight * x`` rounds in bf16 as in a trained
  checkpoint (element std ~0.3).
* **Qwen2 q/k/v biases**: real Qwen2/2.5 checkpoints carry large q/k biases, so ``q_proj`` and
  ``k_proj`` biases are ``N(0, 1)`` (as large as the ``W x`` term); ``v_proj`` bias is smaller,
  ``N(0, 0.2^2)``. Qwen3 has no attention bias (``attention_bias=False``).
* **Final norm / lm_head** are scaled so that next-token logits have std ~``LOGIT_STD`` (2.5),
  which gives a next-token entropy of a few nats on random prompts instead of a near-uniform
  ``ln(vocab)`` (or a near one-hot distribution). Untied: ``lm_head`` is ``N(0, 1/hidden)`` and the
  final norm weight is ``LOGIT_STD * lognormal``. Tied: the shared embedding has std 1, so
  ``<normed h, e_v>`` already has std ``sqrt(hidden)``; the final norm weight is scaled by
  ``LOGIT_STD / sqrt(hidden)`` instead, and gets random signs. Why the signs: in a shallow random
  model the residual stream still contains the input token's own embedding ``e_x``, so with an
  all-positive final norm weight the tied logit ``<w * norm(h), e_x>`` ~ ``sum_j w_j e_xj^2`` is
  ~``sqrt(hidden)`` times larger than the others and the model deterministically repeats its input
  token (measured: entropy ~1 nat, many positions ~0). A trained tied model has learned to
  cancel that; random signs make the self-term zero-mean, like every other logit. The magnitudes
  are still lognormal, so bf16 rounding of ``weight * x`` is unaffected (rounding is symmetric).
  Measured next-token entropy on random-token and arithmetic prompts, default and 8-layer/128-wide
  models, tied or not: ~3.0-3.5 nats (``ln(512)`` = 6.24; per-position range ~0.5-4.6).
* **q/k outlier channels** (``qk_outlier_scale``, default 1.0 = off): real checkpoints have a few
  q/k channels that are many times larger than the rest. For each layer two rotary channel pairs
  ``(i, i + head_dim/2)`` (HF's ``rotate_half`` pairing) are drawn from the low-frequency half of
  the rotary spectrum and the same pairs are amplified in every head: for Qwen2 the matching
  ``q_proj`` / ``k_proj`` output rows *and* bias entries are multiplied by the factor; for Qwen3
  the ``q_norm`` / ``k_norm`` weights of those channels are (scaling the projection rows would be
  largely undone by the per-head RMSNorm that follows them). The channels come from a separate
  generator, so models built with the same seed and different ``qk_outlier_scale`` differ only in
  those channels.

Values are drawn in fp32 from a ``torch.Generator`` seeded with ``seed`` (parameters in
``named_parameters`` order), then cast to bf16; the global torch RNG is not touched. Rows of
padded vocabulary ids (``vocab`` > tokenizer size) are drawn like the others; the tokenizer skips
such ids when decoding.

Tokenizer
---------
A Qwen-like byte-level BPE (same pre-tokenizer regex as Qwen2, so digits are single tokens) is
trained with the ``tokenizers`` library on a locally generated corpus of arithmetic prompts and
plain English. It covers every byte, so any text round-trips. Special tokens ``<|endoftext|>``
(eos and pad), ``<|im_start|>``, ``<|im_end|>`` follow the BPE vocabulary; the BPE size is chosen
so the whole tokenizer has exactly ``TOKENIZER_SIZE`` (512) entries. The chat template is a
minimal ChatML (Qwen) template without a default system prompt. Training is deterministic, so
``tokenizer.json`` is byte-identical across builds.

``vocab=None`` means the tokenizer size rounded up to a multiple of 64.

Saving
------
Everything is built in a temporary sibling directory and renamed onto ``out_dir``, so
``out_dir`` only ever appears complete. An existing ``out_dir`` is replaced only when it is empty
or a previous tiny build (contains ``roundalign_tiny.json``); anything else raises
``FileExistsError``. Same arguments -> byte-identical ``model.safetensors`` and ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import uuid
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3MoeConfig)

ARCHS = ("qwen2", "qwen3", "llama")  # llama: Llama 3.1-style, rope scaling "llama3" (numerics/families.py)
#: the MoE archs make_tiny also builds (not in ARCHS: the dense-model pipelines and their tests iterate over ARCHS)
MOE_ARCHS = ("qwen3_moe",)
#: qwen3_moe defaults: experts per layer, experts per token, and the expert MLP width (None: hidden // 2)
MOE_EXPERTS, MOE_TOP_K = 8, 2

#: Target std of next-token logits on random prompts (gives an entropy of a few nats).
LOGIT_STD = 2.5
#: sigma of the lognormal RMSNorm weights.
NORM_SIGMA = 0.3
#: std of Qwen2 q/k biases and of the v bias.
QK_BIAS_STD = 1.0
V_BIAS_STD = 0.2
#: Rotary channel pairs per head amplified by ``qk_outlier_scale``.
OUTLIER_PAIRS = 2
#: Total tokenizer size (BPE + special tokens); a multiple of 64 so ``vocab=None`` pads nothing.
TOKENIZER_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = PAD_TOKEN = "<|endoftext|>"
META_FILE = "roundalign_tiny.json"
FORMAT_VERSION = 1

# Qwen2's pre-tokenizer regex (digits split into single tokens).
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = """
the a an of to and in is it that for on with as was at by be this are or from but not have
had has you your we our they their he she his her them its what which who when where why how
all any each some many much more most few other such no one two three four five six seven eight
nine ten hundred thousand zero number numbers sum difference product answer question solve
compute calculate add plus minus times multiply subtract equals result value total step first
then next finally check correct wrong right left because so if than there here can will would
could should may might must do does did make made take took give gave find found think know
say said see look use work call try ask need feel become leave put mean keep let begin seem help
show hear play run move live believe bring happen write provide sit stand lose pay meet include
continue set learn change lead understand watch follow stop create speak read allow spend grow
open walk win offer remember love consider appear buy wait serve die send expect build stay fall
cut reach kill remain suggest raise pass sell require report decide pull time year people way
day man woman child world life hand part place case week company system program government
water room mother area money story fact month lot book eye job word business issue side kind
head house service friend father power hour game line end member law car city community name
president team minute idea kid body information back parent face others level office door health
person art war history party morning reason research girl guy moment air teacher force education
quick brown fox jumps over lazy dog good new old great high small large big long little own
""".split()

_TEMPLATES = (
    "What is {a}{op}{b}? {r}",
    "What is {a} {op} {b}? {r}",
    "Compute {a}{op}{b}. Answer: {r}",
    "{a} {op} {b} = {r}",
    "{a}{op}{b}={r}",
    "Calculate {a} {op} {b}. The answer is {r}.",
    "Q: What is {a}{op}{b}?\nA: {r}",
)


def _corpus(seed: int = 0) -> list[str]:
    """Locally generated training text: arithmetic prompts/answers and plain English."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        r = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(rng.choice(_TEMPLATES).format(a=a, b=b, op=op, r=r))
    for _ in range(3000):
        n = rng.randint(4, 14)
        words = [rng.choice(_WORDS) for _ in range(n)]
        s = " ".join(words)
        lines.append(s[0].upper() + s[1:] + rng.choice(".?!,;:"))
    lines += [
        "The quick brown fox jumps over the lazy dog.",
        "system\nYou are a helpful assistant.",
        "user\nWhat is 12+7?",
        "assistant\n19",
        "Please reason step by step, and put your final answer after 'Answer:'.",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 +-*/=?!.,:;()[]{}'\"",
    ]
    return lines


def build_tokenizer():
    """The byte-level BPE tokenizer (a fresh ``tokenizers.Tokenizer`` of TOKENIZER_SIZE entries)."""
    return Tokenizer.from_str(_trained_tokenizer_json())


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() != TOKENIZER_SIZE:  # corpus too small to reach the target
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} entries, expected {TOKENIZER_SIZE}")
    return tok.to_str()


def _wrap_tokenizer(tok, model_max_length: int):
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t != EOS_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _resolve_sizes(arch, hidden, layers, heads, kv_heads, head_dim, intermediate, vocab) -> dict:
    if arch not in ARCHS + MOE_ARCHS:
        raise ValueError(f"unknown arch {arch!r}; valid archs: {', '.join(ARCHS + MOE_ARCHS)}")
    for name, value in (("hidden", hidden), ("layers", layers), ("heads", heads), ("kv_heads", kv_heads)):
        _check_positive(name, value)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads}) when head_dim is not given")
        head_dim = hidden // heads
    else:
        _check_positive("head_dim", head_dim)
        if arch == "qwen2" and head_dim * heads != hidden:
            # Qwen2 (HF and vLLM) derive head_dim = hidden // heads; a decoupled head_dim is Qwen3-only.
            raise ValueError(
                f"head_dim ({head_dim}) must equal hidden // heads ({hidden} // {heads}) for qwen2"
            )
    if head_dim % 2:
        raise ValueError(f"head_dim ({head_dim}) must be even (rotary embeddings rotate channel pairs)")
    if intermediate is None:
        intermediate = 3 * hidden
    _check_positive("intermediate", intermediate)
    if vocab is None:
        vocab = -(-TOKENIZER_SIZE // 64) * 64
    _check_positive("vocab", vocab)
    if vocab < TOKENIZER_SIZE:
        raise ValueError(f"vocab ({vocab}) is smaller than the tokenizer ({TOKENIZER_SIZE} tokens)")
    return dict(head_dim=head_dim, intermediate=intermediate, vocab=vocab)


def _make_config(arch, sizes, *, hidden, layers, heads, kv_heads, tie, max_position_embeddings, rope_theta, tok,
                 moe=None):
    common = dict(
        vocab_size=sizes["vocab"],
        hidden_size=hidden,
        intermediate_size=sizes["intermediate"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=bool(tie),
        use_cache=True,
        use_sliding_window=False,
        max_window_layers=layers,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=tok.token_to_id(EOS_TOKEN),
        pad_token_id=tok.token_to_id(PAD_TOKEN),
    )
    if arch == "qwen2":
        config = Qwen2Config(**common)
        config.architectures = ["Qwen2ForCausalLM"]
    elif arch == "llama":
        for key in ("use_sliding_window", "max_window_layers"):  # Qwen's keys
            common.pop(key)
        # Llama 3.1's RoPE scaling ("llama3": frequencies of wavelength above the original context divided by 8; that
        # context is half of max_position_embeddings here, as transformers wants it below)
        common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": float(rope_theta), "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": max(max_position_embeddings // 2, 1)}
        config = LlamaConfig(head_dim=sizes["head_dim"], attention_bias=False, mlp_bias=False, **common)
        config.architectures = ["LlamaForCausalLM"]
    elif arch == "qwen3_moe":
        for key in ("use_sliding_window", "max_window_layers"):  # not Qwen3-MoE's keys
            common.pop(key)
        # every layer sparse (decoder_sparse_step 1, no mlp_only_layers), renormalised top-k as Qwen3-30B-A3B
        config = Qwen3MoeConfig(head_dim=sizes["head_dim"], attention_bias=False, num_experts=moe["experts"],
                                num_experts_per_tok=moe["top_k"], moe_intermediate_size=moe["intermediate"],
                                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                output_router_logits=False, **common)
        config.architectures = ["Qwen3MoeForCausalLM"]
    else:
        config = Qwen3Config(head_dim=sizes["head_dim"], attention_bias=False, **common)
        config.architectures = ["Qwen3ForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def _lognormal(gen, shape, sigma=NORM_SIGMA):
    return torch.exp(sigma * torch.randn(shape, generator=gen))


@torch.no_grad()
def _init_weights(model, arch: str, *, hidden: int, tie: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    final_scale = LOGIT_STD / math.sqrt(hidden) if tie else LOGIT_STD
    for name, p in model.named_parameters():  # tied lm_head appears once, as embed_tokens
        shape = p.shape
        if name.endswith("embed_tokens.weight"):
            v = torch.randn(shape, generator=gen)
        elif name == "model.norm.weight":
            v = final_scale * _lognormal(gen, shape)
            if tie:  # random signs: no copy-the-current-token bias through the shared embedding
                v = v * (torch.randint(0, 2, shape, generator=gen) * 2 - 1)
        elif name.endswith("norm.weight"):  # input/post-attention layernorm, q_norm, k_norm
            v = _lognormal(gen, shape)
        elif name.endswith(("q_proj.bias", "k_proj.bias")):
            v = QK_BIAS_STD * torch.randn(shape, generator=gen)
        elif name.endswith("v_proj.bias"):
            v = V_BIAS_STD * torch.randn(shape, generator=gen)
        elif name.endswith(".weight") and p.dim() == 2:  # every Linear, incl. untied lm_head and the MoE router
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[1])
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")) and p.dim() == 3:  # per expert a Linear
            v = torch.randn(shape, generator=gen) / math.sqrt(shape[2])
        else:
            raise RuntimeError(f"make_tiny: no init rule for parameter {name} {tuple(shape)}")
        p.copy_(v)


def outlier_pairs(config, seed: int) -> list[list[int]]:
    """Rotary pair indices ``i`` (channels ``i`` and ``i + head_dim/2``) amplified per layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    half = head_dim // 2
    lo = half // 2 if half - half // 2 >= OUTLIER_PAIRS else 0  # low-frequency half of the spectrum
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    n = min(OUTLIER_PAIRS, half - lo)
    return [
        sorted((lo + torch.randperm(half - lo, generator=gen)[:n]).tolist())
        for _ in range(config.num_hidden_layers)
    ]


@torch.no_grad()
def _apply_outliers(model, arch: str, scale: float, seed: int) -> None:
    if scale == 1.0:
        return
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    half = head_dim // 2
    for layer, pairs in zip(model.model.layers, outlier_pairs(cfg, seed)):
        chans = [c for i in pairs for c in (i, i + half)]
        attn = layer.self_attn
        if arch in ("qwen3", "qwen3_moe"):
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight[chans] *= scale
        else:
            for proj, n_heads in ((attn.q_proj, cfg.num_attention_heads), (attn.k_proj, cfg.num_key_value_heads)):
                rows = [h * head_dim + c for h in range(n_heads) for c in chans]
                proj.weight[rows] *= scale
                if proj.bias is not None:  # Qwen2's q/k biases; Llama has none
                    proj.bias[rows] *= scale


def _normalise_modes(d: Path) -> None:
    """save_pretrained writes some files via mkstemp (mode 0600); give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    for f in d.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists() or out_dir.is_symlink():
        if not out_dir.is_dir() or out_dir.is_symlink():
            raise FileExistsError(f"{out_dir} exists and is not a directory")
        if any(out_dir.iterdir()) and not (out_dir / META_FILE).is_file():
            raise FileExistsError(
                f"{out_dir} exists, is not empty and is not a roundalign tiny model; refusing to replace it"
            )
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except BaseException:
            os.rename(old, out_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out_dir)


def make_tiny(
    arch: str,
    out_dir,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    tie: bool = True,
    seed: int = 0,
    qk_outlier_scale: float = 1.0,
    max_position_embeddings: int = 4096,
    rope_theta: float = 1_000_000.0,
    experts: int = MOE_EXPERTS,
    top_k: int = MOE_TOP_K,
    moe_intermediate: int | None = None,
) -> Path:
    """Build a tiny ``arch`` model + tokenizer into ``out_dir`` (atomically) and return its path.

    ``qwen3_moe``: a Qwen3-MoE with ``experts`` experts per layer, ``top_k`` per token (renormalised) and expert MLPs
    ``moe_intermediate`` wide (None: ``hidden // 2``), every layer sparse; the router and each expert's projections
    are initialised like the other Linears (``N(0, 1/fan_in)``). vLLM-CPU's MoE kernel needs ``hidden`` divisible by
    32. ``experts``/``top_k``/``moe_intermediate`` are ignored by the other archs."""
    sizes = _resolve_sizes(arch, hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
    moe = None
    if arch == "qwen3_moe":
        for name, value in (("experts", experts), ("top_k", top_k)):
            _check_positive(name, value)
        if top_k > experts:
            raise ValueError(f"top_k ({top_k}) must be <= experts ({experts})")
        moe_intermediate = hidden // 2 if moe_intermediate is None else moe_intermediate
        _check_positive("moe_intermediate", moe_intermediate)
        moe = dict(experts=experts, top_k=top_k, intermediate=moe_intermediate)
    _check_positive("max_position_embeddings", max_position_embeddings)
    if not (isinstance(rope_theta, (int, float)) and rope_theta > 0):
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
    if not (isinstance(qk_outlier_scale, (int, float)) and math.isfinite(qk_outlier_scale) and qk_outlier_scale > 0):
        raise ValueError(f"qk_outlier_scale must be a finite number > 0, got {qk_outlier_scale!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")

    out_dir = Path(out_dir).expanduser().absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer()
    config = _make_config(
        arch, sizes, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, tie=tie,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta, tok=tok, moe=moe,
    )
    with torch.random.fork_rng(devices=[]):  # HF's own init uses the global RNG; keep the caller's intact
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, arch, hidden=hidden, tie=tie, seed=seed)
    _apply_outliers(model, arch, float(qk_outlier_scale), seed)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16

    eos_ids = [tok.token_to_id(EOS_TOKEN), tok.token_to_id("<|im_end|>")]
    # Explicit plain-sampling defaults. transformers fills an unset top_k with 50 in generate(), and
    # vLLM / TRL read generation_config.json as default sampling params; a silent top-k=50 on one
    # side only would make trainer and engine sample from different distributions, so pin
    # top_k=0 (off), top_p=1.0, temperature=1.0.
    model.generation_config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        temperature=1.0,
        eos_token_id=eos_ids,
        pad_token_id=tok.token_to_id(PAD_TOKEN),
    )

    meta = {
        "format_version": FORMAT_VERSION,
        "arch": arch,
        "args": dict(
            hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            intermediate=intermediate, vocab=vocab, tie=bool(tie), seed=seed,
            qk_outlier_scale=float(qk_outlier_scale), max_position_embeddings=max_position_embeddings,
            rope_theta=float(rope_theta), **({"experts": experts, "top_k": top_k} if moe else {}),
        ),
        "resolved": dict(sizes, tokenizer_size=TOKENIZER_SIZE, **({"moe_intermediate": moe["intermediate"]}
                                                                  if moe else {})),
        "init": dict(
            embed_std=1.0, linear_std="1/sqrt(fan_in)", norm_weight=f"exp(N(0, {NORM_SIGMA:g}^2))",
            final_norm_scale=(LOGIT_STD / math.sqrt(hidden)) if tie else LOGIT_STD,
            final_norm_random_signs=bool(tie),
            qk_bias_std=QK_BIAS_STD if arch == "qwen2" else None,
            v_bias_std=V_BIAS_STD if arch == "qwen2" else None,
            outlier_pairs=outlier_pairs(model.config, seed) if qk_outlier_scale != 1.0 else None,
        ),
    }

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        model.save_pretrained(tmp)
        _wrap_tokenizer(tok, max_position_embeddings).save_pretrained(tmp)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _normalise_modes(tmp)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def random_qwen(arch: str, *, dtype=torch.bfloat16, tie=False, seed=0, hidden=64, layers=2, heads=4, kv_heads=2,
                vocab=128, intermediate=None, attn="eager", device="cpu", rope_parameters=None):
    """An in-memory random Qwen2/Qwen3 (``arch="llama"``: Llama) causal LM with realistic scales (for tests and
    numerics checks; no tokenizer, nothing written): weights ~ N(0, 1/fan_in) so activations are O(1), non-unit norm
    weights (lognormal, sigma 0.3), q/k/v biases ~ N(0, 1). With HF's default init (std 0.02, unit norms) bf16
    ``weight * x`` is exact and the rounding differences under study mostly vanish. RoPE's ``inv_freq`` stays
    fp32, as ``from_pretrained(dtype=bf16)`` and vLLM keep it (``model.to(dtype)`` would cast it)."""
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                          "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    extra = {} if rope_parameters is None else {"rope_parameters": rope_parameters}  # else the config's default
    cfg = cfg_cls(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                  vocab_size=vocab, tie_word_embeddings=tie, max_position_embeddings=4096, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.exp(0.3 * torch.randn_like(p)))
            elif name.endswith("bias"):
                p.normal_(0.0, 1.0)
            elif "embed" in name:
                # tied: the embedding is also the LM head; unit-variance rows would give near-one-hot logits
                p.normal_(0.0, hidden ** -0.5 if tie else 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model = model.to(device=device, dtype=dtype).eval()
    model.model.rotary_emb.inv_freq = inv_freq.to(device)
    model.set_attn_implementation(attn)
    return model
