"""The shipped environments for --env (the interface is in common/env.py, docs/multiturn.md explains both).

calculator   A calculator tool for GSM8K-style problems. The model writes `<calc>12*7+3</calc>`; its turn stops at
             `</calc>` and `<result>87</result>` is appended in-line, the model's message going on after it. A
             malformed or failing call is answered `<result>error: ...</result>` (an observation, never a crash). A
             turn without a call ends the episode; --reward-fn scores the whole text. Expressions are numbers,
             + - * / ** and parentheses, evaluated by walking their `ast` (no eval), with size limits.
try-again    The model answers; a wrong answer (common.rewards.math_reward against the example's answer) is told it was
             wrong in a new user message and may answer again, up to --max-turns answers. Reward: 1 once right.
"""
import ast
import operator
import re

from common.env import Observation
from common.rewards import math_reward

CALC_INSTRUCTION = ("You can use a calculator: write <calc>expression</calc> (numbers, + - * / ** and parentheses) and "
                    "the result comes back as <result>value</result>, for example <calc>(48 - 6) / 7</calc> gives "
                    "<result>6</result>. Give the final answer as \"#### <number>\" on the last line.")
# (the worked example: without it Qwen2.5-Coder-0.5B-Instruct called the tool in 1 of 1,319 greedy
# GSM8K episodes at step 0, docs/multiturn.md)
MAX_EXPR_CHARS = 200      # longer expressions are refused
MAX_NODES = 64            # ... and so are deeper or wider trees
MAX_EXPONENT = 64         # |b| in a ** b
MAX_MAGNITUDE = 1e30      # any intermediate result beyond this is an error (no 9**9**9)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow}
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


class CalcError(ValueError):
    """A call the calculator refuses or cannot evaluate; its message goes back to the model."""


def safe_eval(expr: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / ** (|exponent| <= 64), unary + -, parentheses. Anything
    else (names, calls, attributes, subscripts, strings, comparisons) raises CalcError, as do expressions over 200
    characters or 64 nodes, division by zero, and results beyond 1e30."""
    expr = expr.strip().replace(",", "")  # 1,234 as written in GSM8K
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expr!r}: use numbers, + - * / ** and parentheses") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression larger than {MAX_NODES} nodes")
    return _eval(tree.body)


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, complex or str
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise CalcError(f"exponent {b} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Div) and b == 0:
            raise CalcError("division by zero")
        try:
            return _checked(_OPS[type(node.op)](a, b))
        except (OverflowError, ZeroDivisionError) as e:  # 0 ** -1, float overflow
            raise CalcError(str(e)) from None
    raise CalcError(f"{type(node).__name__} is not allowed: use numbers, + - * / ** and parentheses")


def _checked(v):
    if isinstance(v, complex) or abs(v) > MAX_MAGNITUDE:  # (-8) ** 0.5 is complex
        raise CalcError("result out of range")
    return v


def format_number(v) -> str:
    """87, 2.5, 0.333333: integers as integers, other values to 6 significant digits."""
    if isinstance(v, int) or float(v).is_integer():
        return str(int(v))
    return f"{v:.6g}"


class Calculator:
    """--env calculator: see the module docstring. Observations are in-line (no chat message), so the model's answer
    continues in the same assistant message after each result."""
    stop = ("</calc>",)  # the model's turn ends at the close of a call (common.env.cut_at_stop)

    def step(self, ids, text, state) -> Observation:
        if (m := _CALL.search(text)) is None:
            if "<calc>" in text:  # opened, never closed: the model ended its message, so the error is a new one
                return Observation(text="<result>error: malformed call, write <calc>expression</calc></result>",
                                   role="user", tool_call=True, tool_error=True)
            return Observation(done=True)  # the final answer: --reward-fn scores the episode
        try:
            return Observation(text=f"<result>{format_number(safe_eval(m.group(1)))}</result>", tool_call=True)
        except CalcError as e:
            return Observation(text=f"<result>error: {e}</result>", tool_call=True, tool_error=True)


class TryAgain:
    """--env try-again: see the module docstring. k retries = --max-turns - 1."""
    message = "That answer is not correct. Check your work and try again."

    def reset(self, example):
        return example.answer

    def step(self, ids, text, answer) -> Observation:
        if math_reward("", text, answer) > 0:
            return Observation(reward=1.0, done=True)
        return Observation(text=self.message, role="user", reward=0.0)


BUILTIN_ENVS = {"calculator": Calculator, "try-again": TryAgain}
