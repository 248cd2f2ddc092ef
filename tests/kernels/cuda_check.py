"""Triton kernels on a real GPU against the torch references (pytest runs them on CPU via the interpreter;
this checks what the interpreter cannot: compilation and tf32 dots). Run on a CUDA machine:
    PYTHONPATH=. python3 tests/kernels/cuda_check.py
Prints the largest difference per kernel, dtype and shape."""
import torch
from kvbench.kernels import column_sums as C, triton_attention as TA, merge as M, triton_merge as TM, compact as K, triton_compact as TK, similarity as S, triton_similarity as TS, matching as MA, triton_matching as TMA
from kvbench.kernels.dispatch import use_backend
torch.manual_seed(0); d='cuda'
for dt in (torch.float32, torch.bfloat16, torch.float16):
  for (B,Hq,Hkv,Q,T,D) in [(1,1,1,1,1,16),(2,8,2,1,123,128),(2,4,2,37,123,24),(1,4,1,300,300,64)]:
    q=torch.randn(B,Hq,Q,D,device=d).to(dt);k=torch.randn(B,Hkv,T,D,device=d).to(dt);v=torch.randn(B,Hkv,T,D,device=d).to(dt)
    L=torch.full((B,Hkv),T,device=d); L[-1,0]=T//2
    val=torch.arange(T,device=d).view(1,1,T)<L.unsqueeze(-1); kp=torch.arange(T,device=d).repeat(B,Hkv,1); qp=torch.arange(T-Q,T,device=d).repeat(B,1)
    with use_backend('torch'): o1,l1=C.attention_lse(q,k,v,val,kp,qp,.2); c1,w1=C.column_sums_from_lse(q,k,l1,val,kp,qp,.2,8)
    o2,l2=TA.attention_lse(q,k,v,val,kp,qp,.2); c2,w2=TA.column_sums_from_lse(q,k,l1,val,kp,qp,.2,8)
    print(dt,(B,Hq,Hkv,Q,T,D),'out %.2e lse %.2e col %.2e win %.2e'%((o1.float()-o2.float()).abs().max(),(l1-l2).abs().max(),(c1-c2).abs().max(),(w1-w2).abs().max()))
  x=torch.randn(2,3,1000,128,device=d).to(dt);t=torch.randint(-1,90,(2,3,1000),device=d);w=torch.rand(2,3,1000,device=d)
  with use_backend('torch'): r=M.scatter_merge(x,t,w,90); g=M.group_sum(w,t,90); c=K.compact(x,t.clamp(min=0),torch.full((2,3),700,device=d))
  print('merge %.2e gs %.2e compact %s'%((r.float()-TM.scatter_merge(x,t,w,90).float()).abs().max(),(g-TM.group_sum(w,t,90)).abs().max(),torch.equal(c,TK.compact(x,t.clamp(min=0),torch.full((2,3),700,device=d)))))
  print('cos %.2e'%(S.adjacent_cosine(x)-TS.adjacent_cosine(x)).abs().max(), 'anchor',torch.equal(S.anchor_runs(x[:,:,:200],w[:,:,:200]>.2,torch.full((2,3),150,device=d),.05),TS.anchor_runs(x[:,:,:200],w[:,:,:200]>.2,torch.full((2,3),150,device=d),.05)))
  st=torch.zeros(2,3,dtype=torch.long,device=d);cn=torch.full((2,3),997,device=d)
  for cs in (None,256,7):
    p1,s1=MA.chunked_soft_matching(x,st,cn,cs);p2,s2=TMA.chunked_soft_matching(x,st,cn,cs);print('csm',cs,(p1!=p2).sum().item(),(s1-s2).nan_to_num(0).abs().max().item())
