"""dppo.tools.calculator: Python's arithmetic without eval, errors that name the token, bounded work, and the
<calc> tool-call parser."""

from __future__ import annotations

import ast
import math
import operator
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dppo.tools.calculator import MAX_DEPTH, MAX_INT_BITS, CalculatorError, calculate, evaluate, find_calls

REPO = Path(__file__).resolve().parents[3]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-2 ** 2", "-4"),  # unary minus binds looser than **
        ("2 ** -1", "0.5"),
        ("2 ** 3 ** 2", "512"),  # ** is right-associative
        ("--3", "3"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("10 / 4", "2.5"),
        ("4 / 2", "2"),  # an integral float without ".0"
        ("0.1 + 0.2", "0.3"),  # 12 significant digits
        ("10 / 3", "3.33333333333"),
        ("1e20", "1e+20"),
        ("123456789012345 / 1", "123456789012345"),  # an integral float below 2**53 in full, not as 1.23e+14
        ("2 ** 100", "1267650600228229401496703205376"),  # integers stay exact
        ("sqrt(2) * 10 // 3", "4"),
        ("abs(-3.5) + .5 + 1.", "5"),
        ("  ( 3 + 4.5 ) * 2 ** -1  ", "3.75"),
        ("007", "7"),
    ],
)  # fmt: skip
def test_results_and_their_formatting(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('ls')", "unknown name (the functions are sqrt, abs): '__import__' at position 0"),
        ("2 ^ 3", "unexpected character (use ** for powers): '^' at position 2"),
        ("1 + os.system", "unknown name (the functions are sqrt, abs): 'os' at position 4"),
        ("1 + 2; 3", "unexpected character: ';' at position 5"),
        ("(1 + 2", "parenthesis never closed: '(' at position 0"),
        ("1 + 2)", "unexpected closing parenthesis: ')' at position 5"),
        ("3 4", "unexpected number: '4' at position 2"),
        ("1 +", "expression ends where a number was expected: '' at position 3"),
        ("", "expression ends where a number was expected: '' at position 0"),
        ("sqrt 2", "expected '(' after sqrt, got: '2' at position 5"),
        ("1 / 0", "division by zero: '/' at position 2"),
        ("5 % (2 - 2.0)", "division by zero: '%' at position 2"),
        ("(-8) ** 0.5", "not a real number: '**' at position 5"),
        ("sqrt(-1)", "not a real number: 'sqrt' at position 0"),
        ("1e308 * 10", "result out of range: '*' at position 6"),
        ("1e400", "result out of range: '1e400' at position 0"),
        ("9 ** 9 ** 9", f"result of more than {MAX_INT_BITS} bits: '**' at position 2"),
        ("2 ** 4000 * 2 ** 4000", f"result of more than {MAX_INT_BITS} bits: '*' at position 10"),
        ("٣ + 1", "unexpected character: '٣' at position 0"),
    ],
)  # fmt: skip
def test_errors_name_the_offending_token_and_its_position(expression, message):
    with pytest.raises(CalculatorError) as err:
        calculate(expression)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)


def test_nesting_past_the_depth_limit_is_an_error_not_a_recursion_error():
    for expression in [
        "(" * 150 + "1" + ")" * 150,
        "-" * 150 + "1",
        "2 **" * 150 + "2",
        "sqrt(" * 150 + "1" + ")" * 150,
    ]:
        with pytest.raises(CalculatorError, match=f"nested deeper than {MAX_DEPTH}"):
            evaluate(expression)
    assert calculate("(" * 90 + "1" + ")" * 90) == "1"


def test_an_overlong_expression_is_refused():
    with pytest.raises(CalculatorError, match="expression longer than 2000 characters"):
        evaluate("1+" * 1000 + "1")


def test_a_huge_power_is_refused_before_it_is_computed():
    # in a process of its own, so that a calculator that computes 9 ** 9 ** 9 fails the test instead of hanging it
    code = (
        "from dppo.tools.calculator import evaluate\n"
        "try:\n    evaluate('9 ** 9 ** 9 ** 9')\nexcept ValueError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert out.stdout == f"result of more than {MAX_INT_BITS} bits: '**' at position 7\n", out.stderr


def test_the_error_pickles_with_its_token_and_position():
    err = pickle.loads(pickle.dumps(CalculatorError("division by zero", "/", 2)))
    assert (str(err), err.token, err.position) == ("division by zero: '/' at position 2", "/", 2)


def test_find_calls():
    text = "First <calc>17 * 23</calc>, then <calc>\n (1 + 2) / 3 </calc> and <calc></calc>; <calc>open"
    assert find_calls(text) == ["17 * 23", "(1 + 2) / 3", ""]
    assert find_calls("no call here") == []


# Python's own arithmetic as the reference: the expression's AST (of the test's own string, trusted) evaluated node
# by node with Python's operators, which also tells whether an intermediate integer passed MAX_INT_BITS.
OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
FUNCS = {"sqrt": math.sqrt, "abs": abs}


def python_value(expression: str):
    """Python's value of expression, or None where the calculator must refuse it."""

    def value(node):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.UnaryOp):
            operand = value(node.operand)
            return -operand if isinstance(node.op, ast.USub) else +operand
        if isinstance(node, ast.Call):
            result = FUNCS[node.func.id](value(node.args[0]))
        else:
            result = OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(result, int) and result.bit_length() > MAX_INT_BITS:
            raise OverflowError
        # the calculator checks every intermediate: an infinite one is out of range even where a later ** 0 or a
        # comparison would make the whole finite again (Python: (2 / 1.1e-308) ** 0 == 1.0)
        if isinstance(result, float) and not math.isfinite(result):
            raise OverflowError
        return result

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (ZeroDivisionError, OverflowError, ValueError):
        return None
    if isinstance(result, complex) or (isinstance(result, float) and not math.isfinite(result)):
        return None
    assert result == eval(expression, {"__builtins__": {}, **FUNCS})  # the walker is Python's own evaluation
    return result


numbers = st.one_of(
    st.integers(0, 10**4).map(str),
    st.floats(0, 1e4, allow_nan=False, allow_infinity=False).map(repr),
    st.sampled_from([".5", "3.", "2e3", "1e-3", "0", "0.0"]),
)


binary_ops = st.sampled_from(["+", "-", "*", "/", "//", "%"])


def combine(children):
    return st.one_of(
        # a chain without parentheses: precedence and left-associativity decide (1 - 2 + 3, 8 / 2 * 4 % 3)
        st.tuples(children, st.lists(st.tuples(binary_ops, children), min_size=1, max_size=3)).map(
            lambda t: " ".join([t[0], *(f"{op} {operand}" for op, operand in t[1])])
        ),
        children.map(lambda c: f"({c})"),
        children.map(lambda c: f"-{c}"),
        children.map(lambda c: f"+ {c}"),
        # the base in parentheses: an exponent chain a ** b ** c would be right-associative and unbounded
        st.tuples(children, st.sampled_from(["0", "1", "2", "3", "-1", "-2", "0.5", "-0.5"])).map(
            lambda t: f"({t[0]}) ** {t[1]}"
        ),
        st.tuples(st.sampled_from(["sqrt", "abs"]), children).map(lambda t: f"{t[0]}({t[1]})"),
    )


@SETTINGS
@given(st.recursive(numbers, combine, max_leaves=12))
@example("(2 / 1.1125369292536007e-308) ** 0")  # an infinite intermediate, finite whole (hypothesis found it)
def test_the_calculator_agrees_with_python_on_random_expressions(expression):
    expected = python_value(expression)
    if expected is None:
        with pytest.raises(CalculatorError):
            evaluate(expression)
        return
    got = evaluate(expression)
    assert type(got) is type(expected) and got == expected, (expression, got, expected)
