"""What produced docs/performance.md's PyTorch figures on the H100 (2026-11-24): GPT-2 small, batch 8, seq 1024,
bf16 autocast, AdamW, eager and SDPA attention; median of steps 3-7. scripts/bench_gpu.py does the same and more."""
import time, torch, statistics
from transformers import GPT2Config, GPT2LMHeadModel
for attn in ["eager", "sdpa"]:
    torch.manual_seed(0)
    cfg = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = attn
    m = GPT2LMHeadModel(cfg).cuda().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    B, S, V = 8, 1024, cfg.vocab_size
    rates = []
    for step in range(8):
        tok = torch.randint(0, V, (B, S + 1), device="cuda")
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(tok[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V).float(), tok[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True); loss.backward(); opt.step()
        torch.cuda.synchronize(); dt = time.perf_counter() - t
        if step >= 3: rates.append(B * S / dt)
    r = statistics.median(rates)
    n = sum(p.numel() for p in m.parameters()) - cfg.n_positions * cfg.n_embd
    flops = 6 * n + 12 * cfg.n_layer * S * cfg.n_embd
    print(f"torch {attn} bf16 autocast: {r:.0f} tok/s, {r*flops/1e12:.1f} TFLOP/s, MFU {r*flops/989e12*100:.1f}%")
