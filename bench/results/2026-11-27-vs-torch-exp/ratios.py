"""Best-of-rounds ratios of bench_vs_torch JSON lines: python3 ratios.py FILE..."""
import json,sys
for f in sys.argv[1:]:
    rows=[json.loads(l) for l in open(f)]
    print("==",f, rows[0]['cpu'])
    best={}
    for r in rows:
        b=best.setdefault(r['config'],{})
        for k,v in [('eager',r['torch_tokens_per_s']),('compile',r['torch_compile_tokens_per_s'])]+list(r['optimusc'].items()):
            if isinstance(v,(int,float)): b[k]=max(b.get(k,0),v)
    for c,b in best.items():
        one=b['none 1x1']
        print(f"{c:10s} 1x1/compile {one/b['compile']:.2f}  1x1/eager {one/b['eager']:.2f} | " + "  ".join(f"{k} {b[k]/one:.3f} (vs eager {b[k]/b['eager']:.2f})" for k in ['optimus 2x2','megatron 1x2','megatron 1x4']))
