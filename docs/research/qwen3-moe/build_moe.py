import json, shutil, sys, math, torch
from pathlib import Path
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
base = Path("/tmp/moe/base"); out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/moe/qwen3moe")
bc = json.loads((base / "config.json").read_text())
cfg = Qwen3MoeConfig(
    vocab_size=bc["vocab_size"], hidden_size=128, intermediate_size=384, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=4096, rms_norm_eps=1e-6, rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
    tie_word_embeddings=True, eos_token_id=bc["eos_token_id"], pad_token_id=bc["pad_token_id"], bos_token_id=None,
    hidden_act="silu", output_router_logits=False, dtype="bfloat16",
)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
g = torch.Generator().manual_seed(1234)
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith("embed_tokens.weight"):
            p.copy_(float(__import__("os").environ.get("EMB_STD", "1.0")) * torch.randn(p.shape, generator=g))
        else:
            fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))
        print(name, tuple(p.shape))
model = model.to(torch.bfloat16)
model.save_pretrained(out)
for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"]:
    if (base / f).exists():
        shutil.copy(base / f, out / f)
print(json.dumps(json.loads((out / "config.json").read_text()), indent=1))
