"""A step's performance metrics (perf/*) from its timed phases: seconds, tokens per second per GPU, MFU and peak
memory (docs/performance.md). The scripts time their phases with common.tracking.timed and make one call here."""
import time

from common.flops import batch_train_flops, mfu
from common.tracking import engine_pool_gib, step_peak_gib


def perf_metrics(perf: dict, t_step: float, model_config, lengths: list[int], response_lengths: list[int],
                 trained: list[int], phases: dict[str, tuple[float, bool]], world_size: int, peak_flops: float,
                 device) -> dict:
    """perf/* metrics of the step that began at `t_step` (time.perf_counter()). perf: the step's timed seconds
    (`<phase>_s`) and anything else measured. lengths / response_lengths: tokens of every sequence of the global
    batch (prompt + response / response); trained: the rows that were learned on.
    phases: for each learning phase, (passes over the trained tokens, whether with backward); a phase counts only
    if it was timed. MFU: a forward-only pass is a third of a forward + backward; `mfu` divides by the learning
    phases' seconds, `mfu_step` by the whole step's. Adds what it derives into `perf` as well."""
    perf["step_s"] = time.perf_counter() - t_step
    if device.type == "cuda":
        perf["peak_mem_gib"] = step_peak_gib()  # torch's counter: with a vLLM engine in the process, its pool too
        if pool := engine_pool_gib():  # what the trainer itself used at its peak
            perf["engine_pool_gib"], perf["trainer_peak_gib"] = pool, perf["peak_mem_gib"] - pool
    if trained:
        tokens = sum(lengths[i] for i in trained)
        fpt = batch_train_flops(model_config, [lengths[i] for i in trained],
                                [response_lengths[i] for i in trained]) / tokens
        ran = {name: p for name, p in phases.items() if f"{name}_s" in perf}
        passes = sum(n if backward else n / 3 for n, backward in ran.values())
        train_s = sum(perf[f"{name}_s"] for name in ran)
        perf["mfu"] = mfu(tokens * passes / train_s / world_size, fpt, peak_flops)
        perf["mfu_step"] = mfu(tokens * passes / perf["step_s"] / world_size, fpt, peak_flops)
        for name, (n, _) in ran.items():  # token passes through a model per second per GPU
            perf[f"{name}_tokens_per_s_per_gpu"] = tokens * n / perf[f"{name}_s"] / world_size
    if "generate_s" in perf:  # new tokens only
        perf["generate_tokens_per_s_per_gpu"] = sum(response_lengths) / perf["generate_s"] / world_size
    perf["tokens_per_s_per_gpu"] = sum(lengths) / perf["step_s"] / world_size
    return {f"perf/{k}": v for k, v in perf.items()}
