"""Long-context generation with a transformers model over a context-parallel
world: the prompt prefilled sharded, the KV cache kept sharded by position
(each rank holds about 1/P of it), the new tokens decoded by every rank
alike, then a second turn continued from the sharded cache. Where the
prompt fits one process, the tokens are checked against model.generate.

    mpiexec -n 2 python examples/hf_generate.py
    mpiexec -n 4 python examples/hf_generate.py --model qwen3_moe --prompt 3000
"""

import argparse
import copy
import warnings

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

import commlib
from commlib.bindings import transformers as cht

warnings.filterwarnings("ignore", message=".*deprecated.*")
parser = argparse.ArgumentParser()
parser.add_argument("--model", choices=["llama", "qwen3_moe"], default="llama")
parser.add_argument("--prompt", type=int, default=2001, help="prompt tokens")
parser.add_argument("--new", type=int, default=16, help="tokens to generate")
parser.add_argument("--check-up-to", type=int, default=4096,
                    help="compare with one process's model.generate up to this prompt length")
args = parser.parse_args()

comm = commlib.init()
sizes = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=args.prompt + 2 * args.new + 64)
config = (LlamaConfig(intermediate_size=256, **sizes) if args.model == "llama" else
          Qwen3MoeConfig(moe_intermediate_size=64, num_experts=4 * comm.size,
                         num_experts_per_tok=2, decoder_sparse_step=1, **sizes))


def build():
    torch.manual_seed(0)  # the same model on every rank; a config of its own each
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


model = build()  # whole, to compare with one process
sharded = cht.expert_parallel(build(), comm) if args.model == "qwen3_moe" else model

prompt = torch.randint(512, (1, args.prompt), generator=torch.Generator().manual_seed(1))
out = cht.generate(sharded, prompt, comm, max_new_tokens=args.new, return_dict_in_generate=True)
cache = out.cache if hasattr(out, "cache") else out.past_key_values
follow_up = torch.cat([out.sequences, torch.randint(512, (1, 40),
                                                    generator=torch.Generator().manual_seed(2))],
                      dim=1)
second = cht.generate(sharded, follow_up, comm, max_new_tokens=args.new, past_key_values=cache)

held = comm.mpi_comm.gather(cache.tokens, root=0)
if comm.rank == 0:
    print(f"{comm.size} ranks: cached {cache.length} tokens, per rank {held}")
    print(f"turn 1: {out.sequences[0, args.prompt:].tolist()}")
    print(f"turn 2: {second[0, follow_up.shape[1]:].tolist()}")
    if args.prompt <= args.check_up_to:
        same = (torch.equal(out.sequences, model.generate(prompt, max_new_tokens=args.new,
                                                           do_sample=False))
                and torch.equal(second, model.generate(follow_up, max_new_tokens=args.new,
                                                       do_sample=False)))
        print(f"the same tokens as model.generate in one process: {same}")
