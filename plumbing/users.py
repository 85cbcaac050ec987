"""plumbing/users.py: the simulated users by name, the one place a name becomes a class (`USER_SIMS`): "scripted" (the
environment's own script), "openai" (any OpenAI-compatible endpoint), "hf" (a local model). An entry point's --user-*
options become the simulator's (`user_sim_options`), --user-concurrency shared over the processes. To add a user
simulator, subclass envs.users.UserSim (its `replies`) and name it in USER_SIMS."""
from __future__ import annotations

import os

from envs.llm_users import HFUserSim, OpenAIUserSim
from envs.users import DataUserSim, ScriptedUserSim, UserSim
from muarl import stop_token_ids
from toolcall import template_kwargs
from plumbing import cli, models

USER_SIMS = {"scripted": ScriptedUserSim, "openai": OpenAIUserSim, "hf": HFUserSim}


def check_user_sim(cfg, program: str, resumed: bool = False) -> None:
    """--user-sim one muarl has, and the LLM user's options never given to another (where they would do nothing; a
    run that began so before this check is resumed as it ran: --user-sim cannot change in a resume)."""
    if cfg.user_sim not in USER_SIMS:
        raise SystemExit(f"{program}: --user-sim {cfg.user_sim!r}: not one of {', '.join(USER_SIMS)}")
    default = type(cfg).__dataclass_fields__["user_model"].default  # an endpoint's model name
    llm_options = {"--user-base-url": bool(cfg.user_base_url), "--user-model": cfg.user_model != default}
    given = [option for option, on in llm_options.items() if on]
    if cfg.user_sim == "scripted" and given and not resumed:
        raise SystemExit(f"{program}: {' and '.join(given)}: the options of an LLM user, with the scripted one "
                         "(--user-sim scripted, the default): add --user-sim openai (or hf)")
    if cfg.user_sim == "hf" and cfg.user_model == default:
        raise SystemExit(f"{program}: --user-sim hf: name the local model with --user-model (a checkpoint directory, "
                         f"a hub id or smollm2-135m); the default, {default!r}, is an endpoint's model name")
    if cfg.user_sim == "hf" and not resumed:  # a local path that is no model: now, not once the agent has loaded
        with cli.option_errors(f"{program}: --user-model"):
            models.check_local(cfg.user_model)


def make_user_sim(name: str, **options) -> UserSim:
    """"scripted" (env.scripted_user), "openai" (any OpenAI-compatible endpoint), "hf" (a local model: `model` is
    a loaded model, with `tokenizer`, or a name for models.load_model, with an optional `device`). An LLM user
    leaves the tasks whose user is the data to the environment's script (envs.users.DataUserSim)."""
    if name not in USER_SIMS:
        raise ValueError(f"unknown user simulator {name!r}: use one of {sorted(USER_SIMS)}")
    if name == "hf":
        model, tok = options.pop("model", "smollm2-135m"), options.pop("tokenizer", None)
        if isinstance(model, str):
            with cli.outside_zero3_init():  # evaluated only: never partitioned by a ZeRO-3 run's config
                model, tok = models.load_model(model, device=options.pop("device", None))
        options = dict(model=model, tokenizer=tok, end_of_turn=stop_token_ids(model, tok),
                       template_kwargs=template_kwargs(tok), **options)
    sim = USER_SIMS[name](**options)
    return sim if name == "scripted" else DataUserSim(sim)


def user_concurrency_share(total: int, processes: int) -> int:
    """One process's share of --user-concurrency, which counts the requests of all processes: every process talks
    to the same endpoint, and 8 processes of 64 each would keep 512 in flight."""
    return max(1, -(-total // max(1, processes)))


def user_sim_options(cfg, processes: int | None = None) -> dict:
    """Options of the user simulator named by cfg.user_sim, from the user_* fields of an entry point's config;
    `processes` (default: WORLD_SIZE, set by torchrun and accelerate launch) share --user-concurrency."""
    if cfg.user_sim == "openai":
        processes = processes or int(os.environ.get("WORLD_SIZE", "1"))
        share = user_concurrency_share(cfg.user_concurrency, processes)
        if processes > 1:
            cli.main_print(f"[user] --user-concurrency {cfg.user_concurrency} over {processes} processes: {share} "
                           "requests in flight per process")
        return dict(model=cfg.user_model, base_url=cfg.user_base_url or None, max_concurrency=share,
                    timeout=cfg.user_timeout, max_retries=cfg.user_retries)
    if cfg.user_sim == "hf":
        return dict(model=cfg.user_model)
    return {}


def unanswered(sim) -> str | None:
    """One short request to an endpoint's user simulator (openai), with its retries and timeout: None when it
    answers, else why not (a --overwrite checks it before the run it replaces is removed)."""
    import asyncio

    from envs.users import UserSimError

    inner = getattr(sim, "sim", sim)
    if not isinstance(inner, OpenAIUserSim):
        return None
    try:
        asyncio.run(inner._complete([{"role": "user", "content": "Say OK."}], []))
    except UserSimError as e:
        return str(e)
    return None
