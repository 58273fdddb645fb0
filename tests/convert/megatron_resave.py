"""Reference writer for the layout tests: load a checkpoint into a real Megatron-Core GPTModel at TP×PP and save
it again with Megatron's own ``dist_checkpointing.save`` (what a NeMo training run at that layout writes).

    torchrun --nproc_per_node=TP*PP tests/convert/megatron_resave.py SRC_NEMO_DIR OUT_WEIGHTS_DIR TP PP
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # Megatron's async writer spawns processes that re-import __main__
    from pathlib import Path

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_factuality.convert import cpu
    from nemo_factuality.convert.mapping import spec_from_hf_config, to_te_name
    from nemo_factuality.convert.nemo_format import read_nemo_config
    from nemo_factuality.convert.verify import build_model, load_into

    src, out, tp, pp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cpu.apply()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    nemo_cfg, hf_config = read_nemo_config(src)
    spec = spec_from_hf_config(hf_config, nemo_cfg.get("make_vocab_size_divisible_by"), tp=tp)
    model = build_model(spec, tp, pp, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
    load_into(model, str(src / "model_weights"))
    sharded = model.sharded_state_dict(prefix="model.")  # the local spec already maps norms to TE names
    assert all(v.key == "model." + to_te_name(v.key[len("model."):]) for v in sharded.values())
    Path(out).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, out)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
