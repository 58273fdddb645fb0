"""NeMo-Gym's own code against the project's resources servers; run in the NeMo-Gym venv by test_gym_stack.py.

    python tests/serving/gym_driver.py --project-url URL --head-port PORT --rows ROWS.jsonl --out DIR
    python tests/serving/gym_driver.py --collect-only --head-port PORT --rows ROWS.jsonl --out DIR

1. NeMo-Gym's request/response models and server client (``ServerClient``, ``raise_for_status``) call the project's
   server (``nemo-factuality serve protocol=nemo_gym`` in the project's environment) at ``--project-url``: ``/seed_session``,
   ``/verify`` per row, ``/aggregate_metrics``, and a ``/verify`` whose judge fails.
2. NeMo-Gym's rollout collection (``RolloutCollectionHelper.run_from_config``, what ``ng_collect_rollouts`` runs) over
   ``--rows`` through the servers NeMo-Gym's runner started (head server at ``--head-port``): the simple agent, the
   vLLM model server on the scripted policy, and the project's adapter (``conf/gym/.../app.py``).
3. The runner-started adapter and agent when the judge fails (the adapter's ``/verify``, the agent's ``/run``) and on
   a bad request.

With ``--collect-only``, step 2 alone (the policy a real model behind ``vllm serve``: test_gym_real_policy.py).
Writes ``DIR/driver.json`` (what the test checks) and the rollouts under ``DIR/rollouts*``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path
from urllib.parse import urlparse


def response_of(text: str) -> dict:
    """A policy output as NeMo-Gym's models build it (``NeMoGymResponse``, one assistant message)."""
    from nemo_gym.openai_utils import NeMoGymResponse, NeMoGymResponseOutputMessage, NeMoGymResponseOutputText

    message = NeMoGymResponseOutputMessage(id="msg_0", content=[NeMoGymResponseOutputText(text=text, annotations=[])])
    return NeMoGymResponse(id="resp_0", created_at=0, model="policy", object="response", output=[message],
                           parallel_tool_calls=False, tool_choice="auto", tools=[]).model_dump(mode="json")


async def failure(client, server: str, path: str, body: dict) -> dict:
    """Post ``body``; NeMo-Gym's ``raise_for_status`` must raise: its status and the body NeMo-Gym keeps."""
    from aiohttp import ClientResponseError
    from nemo_gym.server_utils import raise_for_status

    response = await client.post(server_name=server, url_path=path, json=body)
    try:
        await raise_for_status(response)
    except ClientResponseError as err:
        return {"status": err.status, "content": err.response_content.decode()}
    raise AssertionError(f"{server}{path} answered {response.status} to a request that must fail")


async def call_project(url: str, head_port: int, rows: list[dict], outage_row: dict) -> dict:
    from nemo_gym.config_types import AggregateMetrics, AggregateMetricsRequest, BaseServerConfig
    from nemo_gym.server_utils import ServerClient, get_response_json, raise_for_status
    from omegaconf import OmegaConf
    from responses_api_agents.simple_agent.app import SimpleAgentVerifyRequest, SimpleAgentVerifyResponse

    where = urlparse(url)
    client = ServerClient(head_server_config=BaseServerConfig(host="127.0.0.1", port=head_port),
                          global_config_dict=OmegaConf.create({"project": {"resources_servers": {"nemo_factuality": {
                              "host": where.hostname, "port": where.port}}}}))
    replies = []
    for full in rows:
        row = {k: v for k, v in full.items() if k != "policy_text"}
        seeded = await client.post(server_name="project", url_path="/seed_session", json=row)
        await raise_for_status(seeded)
        request = SimpleAgentVerifyRequest.model_validate({**row, "response": response_of(full["policy_text"])})
        response = await client.post(server_name="project", url_path="/verify", json=request)
        await raise_for_status(response)
        replies.append(SimpleAgentVerifyResponse.model_validate(await get_response_json(response)).model_dump(mode="json"))
    stripped = [{k: v for k, v in r.items() if k not in ("response", "responses_create_params")} for r in replies]
    aggregate = await client.post(server_name="project", url_path="/aggregate_metrics",
                                  json=AggregateMetricsRequest(verify_responses=stripped))
    await raise_for_status(aggregate)
    metrics = AggregateMetrics.model_validate(await get_response_json(aggregate)).model_dump(mode="json")
    outage = SimpleAgentVerifyRequest.model_validate({**{k: v for k, v in outage_row.items() if k != "policy_text"},
                                                      "response": response_of(outage_row["policy_text"])})
    return {"replies": replies, "aggregate": metrics,
            "outage": await failure(client, "project", "/verify", outage.model_dump(mode="json"))}


async def collect(rows_path: Path, out: Path, agent: str) -> dict:
    from nemo_gym.rollout_collection import RolloutCollectionConfig, RolloutCollectionHelper

    config = RolloutCollectionConfig(agent_name=agent, input_jsonl_fpath=str(rows_path),
                                     output_jsonl_fpath=str(out / "rollouts.jsonl"), upload_rollouts_to_wandb=False)
    results = await RolloutCollectionHelper().run_from_config(config)
    return {"results": len(results)}


async def runner_failures(agent: str, outage_row: dict) -> dict:
    """The runner's adapter and agent, reached by name through the head server's config as NeMo-Gym's servers do."""
    from nemo_gym.server_utils import ServerClient

    client = ServerClient.load_from_global_config()
    row = {k: v for k, v in outage_row.items() if k != "policy_text"}
    verify = {**row, "response": response_of(outage_row["policy_text"])}
    return {"adapter_outage": await failure(client, "nemo_factuality", "/verify", verify),
            "adapter_bad_request": await failure(client, "nemo_factuality", "/verify", {"response": {"output": []}}),
            "agent_outage": await failure(client, agent, "/run", row)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project-url", help="the project's own server (steps 1 and 3)")
    ap.add_argument("--head-port", type=int, required=True)
    ap.add_argument("--rows", type=Path, required=True, help="the rows to collect (one with policy_text per line)")
    ap.add_argument("--outage-row", help="JSON: a row whose response makes the judge fail (steps 1 and 3)")
    ap.add_argument("--collect-only", action="store_true", help="step 2 only (a real policy: no scripted outage)")
    ap.add_argument("--agent", default="nemo_factuality_simple_agent")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # What NeMo-Gym's runner hands its child processes: the head server, from which the rest of the config comes.
    os.environ["NEMO_GYM_CONFIG_DICT"] = json.dumps({"head_server": {"host": "127.0.0.1", "port": args.head_port}})
    rows = [json.loads(line) for line in args.rows.read_text().splitlines() if line.strip()]
    outage_row = None if args.collect_only else json.loads(args.outage_row)
    collectable = args.out / "rows.jsonl"  # rollout collection asks the policy: no policy_text in its rows
    collectable.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "policy_text"}) + "\n" for r in rows))

    async def run_all() -> dict:
        if args.collect_only:
            return {"collect": await collect(collectable, args.out, args.agent)}
        return {"project": await call_project(args.project_url, args.head_port, rows, outage_row),
                "collect": await collect(collectable, args.out, args.agent),
                "runner": await runner_failures(args.agent, outage_row)}

    (args.out / "driver.json").write_text(json.dumps(asyncio.run(run_all()), indent=1))


if __name__ == "__main__":
    main()
