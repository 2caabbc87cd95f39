"""Tiny Qwen2/Qwen3 builder (roundalign.models.tiny) and offline loaders (roundalign.models.load)."""

import json
import math

import pytest
import torch
from transformers import PreTrainedTokenizerFast

torch.set_num_threads(1)

from roundalign.models import tiny  # noqa: E402
from roundalign.models.load import load_model, load_tokenizer, resolve_model_path  # noqa: E402
from roundalign.models.tiny import ARCHS, make_tiny  # noqa: E402

PROMPT = "What is 12+7? 19"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(arch, tie) -> path of a default-size build; built once per module."""
    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(arch, tie=True, **kw):
        key = (arch, tie, tuple(sorted(kw.items())))
        if key not in cache:
            name = f"{arch}-{'tied' if tie else 'untied'}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
            cache[key] = make_tiny(arch, root / name, tie=tie, **kw)
        return cache[key]

    return get


def _entropy(logits):
    lp = logits.float().log_softmax(-1)
    return -(lp.exp() * lp).sum(-1)


# ---------------------------------------------------------------------------------------- build / load


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
def test_build_and_load(built, arch, tie):
    path = built(arch, tie)
    assert sorted(p.name for p in path.parent.iterdir() if p.name.startswith(".")) == []  # no temp leftovers
    files = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "roundalign_tiny.json")
    for f in files:
        assert (path / f).is_file(), f
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["model_type"] == arch and cfg["tie_word_embeddings"] is tie

    model = load_model(str(path))
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                     "llama": "LlamaForCausalLM"}[arch]
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    attn = model.model.layers[0].self_attn
    if arch == "qwen2":
        assert all(getattr(attn, n).bias is not None for n in ("q_proj", "k_proj", "v_proj"))
        assert attn.q_proj.bias.float().std() > 0.5  # realistic (large) q bias, not zeros
        assert not hasattr(attn, "q_norm")
    elif arch == "qwen3":
        assert attn.q_proj.bias is None and attn.k_proj.bias is None
        assert attn.q_norm.weight.shape == (model.config.head_dim,) and hasattr(attn, "k_norm")
    else:  # llama: no biases, no q/k norms, Llama 3.1's rope scaling
        assert attn.q_proj.bias is None and not hasattr(attn, "q_norm")
        assert model.config.rope_parameters["rope_type"] == "llama3"
    shared = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert shared is tie
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= tiny.TOKENIZER_SIZE

    gc = model.generation_config
    assert (gc.top_k, gc.top_p, gc.temperature) == (0, 1.0, 1.0)

    meta = json.loads((path / "roundalign_tiny.json").read_text())
    assert meta["arch"] == arch and meta["args"]["tie"] is tie and meta["args"]["seed"] == 0
    assert meta["resolved"]["vocab"] == model.config.vocab_size


def test_load_model_dtype_attn_and_generate(built):
    path = str(built("qwen3"))
    m32 = load_model(path, dtype="fp32", attn="sdpa")
    assert m32.dtype == torch.float32 and m32.config._attn_implementation == "sdpa"
    tok = load_tokenizer(path)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    torch.manual_seed(0)
    out = m32.generate(ids, max_new_tokens=4, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[1] <= ids.shape[1] + 4
    assert load_model(path, dtype="fp16").dtype == torch.float16


def test_deterministic_and_rng_untouched(tmp_path):
    state = torch.get_rng_state()
    a = make_tiny("qwen2", tmp_path / "a", seed=3)
    b = make_tiny("qwen2", tmp_path / "b", seed=3)
    c = make_tiny("qwen2", tmp_path / "c", seed=4)
    assert torch.equal(torch.get_rng_state(), state)  # caller's global RNG not consumed
    for f in ("model.safetensors", "tokenizer.json", "config.json", "roundalign_tiny.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------------------------- scales


@pytest.mark.parametrize("arch", ARCHS)
def test_norm_weights_non_unit(built, arch):
    model = load_model(str(built(arch)))
    norms = {n: p.float() for n, p in model.named_parameters() if n.endswith("norm.weight")}
    n_layers = model.config.num_hidden_layers
    expected = 2 * n_layers + 1 + (2 * n_layers if arch == "qwen3" else 0)  # (+ q_norm, k_norm)
    assert len(norms) == expected
    for name, w in norms.items():
        if name == "model.norm.weight":  # scaled (and, tied, signed) to set the logit scale
            assert w.abs().std() / w.abs().mean() > 0.1, name
        else:
            assert w.std() > 0.1 and w.min() > 0, name
            assert 0.7 < w.mean() < 1.4, name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tie", [True, False])
def test_activation_scales_and_entropy(built, arch, tie):
    model = load_model(str(built(arch, tie)))
    tok = load_tokenizer(str(built(arch, tie)))
    g = torch.Generator().manual_seed(1)
    rand_ids = torch.randint(0, len(tok) - len(tiny.SPECIAL_TOKENS), (8, 32), generator=g)
    pre_norm = {}
    h = model.model.norm.register_forward_hook(lambda m, i, o: pre_norm.update(x=i[0]))  # returns None
    with torch.no_grad():
        out = model(rand_ids, output_hidden_states=True)
    h.remove()
    # hidden_states = (embeddings, layer 1, ..., layer L-1, final-normed); replace the last by the
    # pre-norm output of layer L. Measured (default 2-layer): ~1.0, ~1.4, ~1.8 -> O(1) and growing.
    rms = [x.float().pow(2).mean().sqrt().item() for x in (*out.hidden_states[:-1], pre_norm["x"])]
    assert all(0.3 < r < 30 for r in rms), rms
    assert rms[-1] > rms[0], rms  # residual stream grows across layers

    # Next-token entropy. Measured mean ~3.0-3.5 nats for both archs, tied or not, on random tokens
    # and on arithmetic prompts (ln(512) = 6.24; per-position range ~0.5-4.6). Bounds: clearly
    # below uniform and clearly above a one-hot/copying model.
    ln_v = math.log(model.config.vocab_size)
    ent_rand = _entropy(out.logits).mean().item()
    enc = tok([f"What is {i * 7}+{i * 13}?" for i in range(8)], return_tensors="pt", padding=True)
    with torch.no_grad():
        ent_text = _entropy(model(**enc).logits)[enc.attention_mask.bool()].mean().item()
    for ent in (ent_rand, ent_text):
        assert 1.5 < ent < 0.8 * ln_v, (ent_rand, ent_text, ln_v)


def _q_channel_ratio(model, arch):
    """max / median over q channels of mean |q| (q after bias for qwen2, after q_norm for qwen3)."""
    caught = []
    attn = model.model.layers[0].self_attn
    mod = attn.q_norm if arch == "qwen3" else attn.q_proj
    h = mod.register_forward_hook(lambda m, i, o: caught.append(o))  # returns None: output unchanged
    ids = torch.randint(0, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    h.remove()
    q = caught[0].float().reshape(-1, model.config.num_attention_heads, attn.head_dim)
    per_chan = q.abs().mean(0).reshape(-1)
    return (per_chan.max() / per_chan.median()).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_outlier_scale(built, arch):
    base = load_model(str(built(arch)))
    boosted = load_model(str(built(arch, qk_outlier_scale=8.0)))
    r0, r1 = _q_channel_ratio(base, arch), _q_channel_ratio(boosted, arch)
    assert r1 > 2 * r0, (r0, r1)
    # Only the outlier channels differ (same seed).
    sd0, sd1 = base.state_dict(), boosted.state_dict()
    changed = {n for n in sd0 if not torch.equal(sd0[n], sd1[n])}
    if arch == "qwen3":
        allowed = ("q_norm.weight", "k_norm.weight")
    else:
        allowed = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")
    assert changed and all(n.endswith(allowed) for n in changed), changed
    meta = json.loads((built(arch, qk_outlier_scale=8.0) / "roundalign_tiny.json").read_text())
    assert meta["args"]["qk_outlier_scale"] == 8.0 and len(meta["init"]["outlier_pairs"]) == 2


# ---------------------------------------------------------------------------------------- tokenizer


def test_tokenizer(built):
    tok = load_tokenizer(str(built("qwen2")))
    assert isinstance(tok, PreTrainedTokenizerFast)
    ids = tok(PROMPT).input_ids
    assert tok.decode(ids) == PROMPT
    assert [tok.decode([i]) for i in tok("12345").input_ids] == list("12345")  # digits split like Qwen
    for s in ("The quick brown fox, 3*4=12!", "ünïcödé ☃ tab\tnewline\n"):
        assert tok.decode(tok(s).input_ids) == s  # byte-level: everything round-trips
    vocab = tok.get_vocab()
    assert all(t in vocab for t in tiny.SPECIAL_TOKENS)
    assert tok.eos_token == tok.pad_token == "<|endoftext|>"
    assert len(tok) == tiny.TOKENIZER_SIZE
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+7?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12+7?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok(text).input_ids.count(vocab["<|im_start|>"]) == 3  # specials are single tokens


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(arch="qwen5"), r"qwen5.*qwen2.*qwen3"),
        (dict(hidden=66), "hidden"),
        (dict(heads=4, kv_heads=3), "kv_heads"),
        (dict(layers=0), "layers"),
        (dict(head_dim=32), "head_dim"),  # qwen2 requires head_dim == hidden // heads
        (dict(arch="qwen3", head_dim=15), "head_dim"),
        (dict(vocab=256), "vocab"),
    ],
)
def test_make_tiny_bad_args(tmp_path, kwargs, match):
    kwargs = {"arch": "qwen2", **kwargs}
    with pytest.raises(ValueError, match=match):
        make_tiny(kwargs.pop("arch"), tmp_path / "m", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_qwen3_decoupled_head_dim(tmp_path):
    model = load_model(str(make_tiny("qwen3", tmp_path / "m", head_dim=32, vocab=576)))
    assert model.config.head_dim == 32 and model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
    assert model.config.vocab_size == 576


def test_resolve_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="/nonexistent/tiny-model"):
        resolve_model_path("/nonexistent/tiny-model")
    with pytest.raises(FileNotFoundError, match="missing-dir"):
        load_model("./missing-dir")
    with pytest.raises(FileNotFoundError, match="a/b/c"):
        resolve_model_path("a/b/c")
    empty = tmp_path / "no-config"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no-config.*config.json"):
        load_model(str(empty))
    with pytest.raises(FileNotFoundError, match=r"(?s)local Hugging Face cache.*huggingface-cli download"):
        resolve_model_path("roundalign-test-org/surely-not-cached-0xdeadbeef")


def test_load_bad_dtype_attn(built):
    path = str(built("qwen2"))
    with pytest.raises(ValueError, match="bf16, fp16, fp32"):
        load_model(path, dtype="float8")
    with pytest.raises(ValueError, match="eager, sdpa"):
        load_model(path, attn="flash")


# ---------------------------------------------------------------------------------------- atomic write


def test_atomic_write(tmp_path, monkeypatch):
    out = tmp_path / "m"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "_wrap_tokenizer", boom)  # fails after the weights were written
    with pytest.raises(RuntimeError, match="disk full"):
        make_tiny("qwen2", out)
    assert list(tmp_path.iterdir()) == []  # neither out_dir nor the temp dir is left behind
    monkeypatch.undo()

    make_tiny("qwen2", out)
    first = (out / "model.safetensors").read_bytes()
    make_tiny("qwen2", out, seed=1)  # a previous tiny build is replaced whole
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "roundalign_tiny.json").read_text())["args"]["seed"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    other = tmp_path / "precious"
    other.mkdir()
    (other / "data.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="precious"):
        make_tiny("qwen2", other)
    assert (other / "data.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "precious"]
