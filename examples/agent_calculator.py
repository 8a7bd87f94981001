"""Train your own agent: a calculator agent, written with the official ``openai`` client, served to fastexp.

The agent solves arithmetic word problems. Each step it calls the model with a ``calculator`` tool; when the reply
asks for the tool, the agent evaluates the expression itself (:func:`calculate`: a small evaluator over Python's
``ast``, never ``eval``), appends the reply and the result, and calls again, at most ``max_calls`` times. Its final
answer earns reward 1.0 when math-verify finds it equal to the reference, else 0.0.

fastexp runs it as an *agent server* (docs/agents.md): for each sample the experience service POSTs ``/episode``
with the prompt and a gateway session (``base_url``, ``api_key``, ``model``); every model call made with that
session is recorded token-exact and becomes the sample's row(s); the answer ``{"reward", "metrics"}`` scores it.

Run::

    .venv/bin/python examples/agent_calculator.py serve --port 8100   # the agent server alone (an operator's)
    make agent-demo   # the three services, this agent, and a few batches streamed with agent=calculator

SmolLM2-135M (the embedded default) rarely calls the tool correctly: the demo runs either way, and training is
what would teach it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import typer
import uvicorn
from fastapi import FastAPI
from openai import AsyncOpenAI, BadRequestError
from pydantic import BaseModel

#: SmolLM2's chat template does not render ``tools``: the system prompt shows the call format (Hermes-style blocks,
#: which the gateway parses into ``tool_calls``).
SYSTEM = ("Solve the problem. For arithmetic, call the calculator like this: <tool_call>{\"name\": \"calculator\", "
          "\"arguments\": {\"expression\": \"(3+4)*12\"}}</tool_call>. After its result, state the final answer as "
          "\\boxed{number}.")
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, + - * / ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*12"}},
                   "required": ["expression"]},
}}
#: The demo's word problems: (question, reference answer).
PROBLEMS = [
    ("A baker makes 12 trays of 24 cookies and sells 150 cookies. How many cookies are left?", "138"),
    ("A train travels 84 km per hour for 3 hours, then 60 km per hour for 2 hours. How far does it go?", "372"),
    ("Tickets cost 7 dollars for adults and 4 dollars for children. What do 3 adults and 5 children pay?", "41"),
    ("A tank holds 250 litres and drains 18 litres a minute. How many litres are left after 9 minutes?", "88"),
    ("Each of 6 boxes holds 15 apples. The apples are shared equally by 9 children. How many does each get?", "10"),
    ("A shop sells pens at 3 for 2 dollars. How many dollars do 27 pens cost?", "18"),
    ("A square garden has sides of 17 metres. What is its area in square metres?", "289"),
    ("Sam saves 35 dollars a week. How many weeks until he has 420 dollars?", "12"),
]

# --- the tool: arithmetic over Python's ast, nothing else ------------------------------------------------------
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # |b| in a ** b
MAX_MAGNITUDE = 10**100  # any intermediate value beyond it is refused
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses: not arithmetic on numbers, too long, too large, or undefined."""


def calculate(expression: str) -> int | float:
    """The value of ``expression``: int and float literals, + - * / ** (unary + -) and parentheses.

    Raises:
        CalculatorError: anything else (names, calls, attributes, strings, booleans), more than
            :data:`MAX_EXPRESSION_CHARS` characters, an exponent beyond :data:`MAX_EXPONENT`, a value beyond
            :data:`MAX_MAGNITUDE`, division by zero, a complex result.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an expression: {error.msg}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): True is not a number here
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is beyond {MAX_EXPONENT}")
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except (ZeroDivisionError, OverflowError) as error:
            raise CalculatorError(str(error)) from error
    raise CalculatorError(f"not arithmetic: {ast.unparse(node)}")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("the value is complex or too large")
    return value


def run_tool(name: str, arguments: str) -> str:
    """One tool call's result as the tool message's text (errors too: the model should see what went wrong)."""
    try:
        values = json.loads(arguments)
        expression = values.get("expression") if name == "calculator" and isinstance(values, dict) else None
        if not isinstance(expression, str):
            return f"error: call calculator with {{\"expression\": \"...\"}}, not {name} {arguments}"
        value = calculate(expression)
    except (json.JSONDecodeError, CalculatorError) as error:
        return f"error: {error}"
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# --- the agent: the official client against the session's base_url ----------------------------------------------
@dataclass
class Episode:
    """What one episode did: the final answer and every reply as the agent received it (content, tool calls)."""

    answer: str = ""
    replies: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0


# --8<-- [start:solve]
async def solve(client: AsyncOpenAI, model: str, messages: list[dict], max_calls: int, max_tokens: int,
                temperature: float) -> Episode:
    """The agent's loop: call the model with the calculator; run the tool calls it asks for; call again; stop at a
    reply without tool calls or after ``max_calls`` calls (or when the session allows no more)."""
    episode, messages = Episode(), [{"role": "system", "content": SYSTEM}, *messages]
    for _ in range(max_calls):
        try:
            completion = await client.chat.completions.create(
                model=model, messages=messages, tools=[CALCULATOR], max_tokens=max_tokens, temperature=temperature)
        except BadRequestError as error:  # the episode's max_calls (the request's AgentOptions) is reached
            if (error.body or {}).get("param") != "max_calls":
                raise
            break
        reply = completion.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in reply.tool_calls or []]
        episode.replies.append({"content": reply.content or "", "tool_calls": calls})
        episode.answer = reply.content or ""
        if not calls:
            break
        messages.append(reply.model_dump(exclude_none=True))  # the reply as received: the row goes on token-exact
        for call, (name, arguments) in zip(reply.tool_calls or [], calls, strict=True):
            result = run_tool(name, arguments)
            episode.tool_errors += result.startswith("error:")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return episode
# --8<-- [end:solve]


def reward(answer: str, reference: str) -> float:
    """1.0 when math-verify finds the answer's final value equal to the reference, else 0.0."""
    from math_verify import parse, verify

    gold, predicted = parse(reference), parse(answer)
    return float(bool(gold) and bool(predicted) and verify(gold, predicted))


class SessionInfo(BaseModel):
    base_url: str  # the gateway's /v1
    api_key: str  # this episode's session key (expires with the episode)
    model: str


class EpisodeRequest(BaseModel):
    """What the experience service POSTs for each sample (docs/agents.md, "The agent-server protocol")."""

    episode_id: str
    messages: list[dict[str, Any]]  # the prompt as chat messages
    prompt: str
    reference: str
    label: str
    session: SessionInfo


# --8<-- [start:server]
def agent_app(max_calls: int = 4, max_tokens: int = 256, temperature: float = 1.0,
              transcripts: list[dict] | None = None) -> FastAPI:
    """The agent server: ``POST /episode`` -> ``{"reward": 0|1, "metrics": {...}}``; each episode's request messages
    and replies are appended to ``transcripts`` when given (tests, debugging)."""
    app = FastAPI(title="calculator agent")

    @app.post("/episode")
    async def episode(body: EpisodeRequest) -> dict[str, Any]:
        session = body.session
        async with AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0) as client:
            done = await solve(client, session.model, body.messages, max_calls, max_tokens, temperature)
        if transcripts is not None:
            transcripts.append({"messages": body.messages, "replies": done.replies})
        tool_calls = sum(len(r["tool_calls"]) for r in done.replies)
        return {"reward": reward(done.answer, body.reference),
                "metrics": {"tool_calls": tool_calls, "tool_errors": done.tool_errors}}

    return app
# --8<-- [end:server]


# --- the command line: serve the agent, or the whole demo ---------------------------------------------------------
main = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])


@main.command()
def serve(host: str = "127.0.0.1", port: int = 8100, max_calls: int = 4) -> None:
    """Serve the agent until Ctrl-C (an operator names http://HOST:PORT/episode in the experience's `agents`)."""
    uvicorn.run(agent_app(max_calls), host=host, port=port)


@main.command()
def demo(num_prompts: int = 4, n_samples_per_prompt: int = 2, max_calls: int = 4, max_tokens: int = 256,
         backend: str = "auto", out: Path = Path("out/agent-demo")) -> None:  # noqa: B008 - typer reads the default
    """Start the three services on the embedded SmolLM2 with this agent and stream a few batches."""
    from services.common.models import resolve_model
    from services.launcher import LocalCluster, free_port, fresh_state_dir

    model = resolve_model("smollm2-135m-instruct")
    listener = socket.create_server(("127.0.0.1", 0))  # the agent server's port, bound before the services start
    agents = {"calculator": {"url": f"http://127.0.0.1:{listener.getsockname()[1]}/episode", "timeout_s": 900}}
    overrides = {"generator": {"model": model, "backend": backend, "max_model_len": 2048},
                 "experience": {"actor_model": model, "reference_model": model, "gateway_port": free_port(),
                                "agents": json.dumps(agents)}}
    with LocalCluster(overrides=overrides, log_dir=out / "logs", state_dir=fresh_state_dir(out / "state")) as cluster:
        server = uvicorn.Server(uvicorn.Config(agent_app(max_calls, max_tokens), log_level="warning"))

        async def run() -> None:
            serving = asyncio.create_task(server.serve(sockets=[listener]))
            await asyncio.to_thread(print_batches, cluster.address("experience"), model,
                                    PROBLEMS[:num_prompts], n_samples_per_prompt, max_calls)
            server.should_exit = True
            await serving

        asyncio.run(run())


def stream_batches(address: str, problems: list[tuple[str, str]], n_samples_per_prompt: int, max_calls: int):
    """The trainer's side: MakeExperiences with ``agent=calculator``; yields each Experience batch."""
    from fastexp import AgentOptions, ExperienceClient

    with ExperienceClient(address, timeout_s=1800) as client:
        yield from client.make_experiences(
            [[{"role": "user", "content": question}] for question, _ in problems],
            references=[answer for _, answer in problems], n_samples_per_prompt=n_samples_per_prompt,
            advantage_estimator="group_norm", agent=AgentOptions("calculator", max_calls=max_calls),
        )


def sampled_text(experience, row: int, tokenizer) -> str:
    """What the model sampled in ``row`` (the tokens where ``action_mask`` is 1), decoded."""
    mask = experience.action_mask[row]
    return tokenizer.decode(experience.sequences[row, -mask.shape[0]:][mask].tolist())


#: Per-row figures of an agent episode in ``reward_metrics``: the service's (rows, drift splits, calls) and this
#: agent's own (its answer's ``metrics``).
EPISODE_METRICS = ("num_rows", "drift_splits", "num_calls", "tool_calls", "tool_errors")


def print_batches(address: str, model: str, problems: list[tuple[str, str]], n_samples_per_prompt: int,
                  max_calls: int) -> None:
    """Stream and print per batch: rows, reward mean, the episode metrics, and row 0's sampled text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    for experience in stream_batches(address, problems, n_samples_per_prompt, max_calls):
        metrics = experience.reward_metrics
        figures = ", ".join(f"{name} {float(metrics[name].nanmean()):.2f}" for name in EPISODE_METRICS
                            if name in metrics)
        print(f"batch {experience.batch_index}: {len(experience.prompt_index)} rows, reward mean "
              f"{float(experience.reward.mean()):.2f}, {figures}")
        print(f"  row 0 sampled: {sampled_text(experience, 0, tokenizer)!r}")


if __name__ == "__main__":
    main()
