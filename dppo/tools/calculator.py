"""A calculator for model-written arithmetic, and the parser of its tool calls (`<calc>EXPRESSION</calc>`).

    calculate("(3 + 4.5) * 2 ** -1")       # "3.75"
    calculate("sqrt(2) * 10 // 3")         # "4"
    find_calls("so <calc>17 * 23</calc> is")  # ["17 * 23"]

The language is Python's arithmetic and gives Python's results (evaluate(e) == eval(e) wherever both give a real
number): integer and decimal literals (`12`, `0.5`, `.5`, `1.`, `2e3`), `+ - * / // % **` with Python's precedence
and associativity (`-2 ** 2` is -4, `2 ** 3 ** 2` is 512), unary `+` and `-`, parentheses, and the functions
`sqrt(x)` and `abs(x)`. Anything else is a CalculatorError (a ValueError) that names the offending token and its
position (0-based, in characters): `__import__('os').system('ls')` fails on the name `__import__` at 0; `2 ^ 3` on
`^` (with a hint to use `**`). Division by zero, a result that is not a real number (`(-8) ** 0.5`) and a result out
of range (`1e308 * 10`) are CalculatorErrors too, naming the operator. One difference from Python: an integer may
have leading zeros (`007` is 7).

Why it runs in the caller's process, with no sandbox: it never calls eval, exec, compile or ast on its input; it is a
hand-written tokenizer (a fixed regular expression of numbers, names, operators) and a recursive-descent parser that
computes as it parses, so the only operations the input can reach are the arithmetic operators and the two
functions above. Its work is bounded before it is done: an input of at most MAX_LENGTH characters, parentheses,
unary signs and `**` nested at most MAX_DEPTH deep (so the recursion stays far from Python's limit), every integer,
literal or intermediate, of at most MAX_INT_BITS bits, and `**` between integers refused before it is computed when
its result would pass that (`9 ** 9 ** 9` fails in microseconds instead of running for hours). Float operations are
constant-time.
"""

from __future__ import annotations

import math
import re

MAX_LENGTH = 2000
MAX_DEPTH = 100
MAX_INT_BITS = 4096  # about 1233 decimal digits
FUNCTIONS = {"sqrt": math.sqrt, "abs": abs}

_TOKEN = re.compile(
    r"\s*(?:(?P<number>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>\*\*|//|[-+*/%()]))",
    re.ASCII,  # digits and names in ASCII only, as in Python source
)
_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot compute; .token and .position (0-based) name where."""

    def __init__(self, message: str, token: str, position: int) -> None:
        super().__init__(f"{message}: {token!r} at position {position}")
        self.message, self.token, self.position = message, token, position

    def __reduce__(self):  # pickles (to another process) with its three arguments, not the formatted message
        return type(self), (self.message, self.token, self.position)


def find_calls(text: str) -> list[str]:
    """The expressions of every `<calc>EXPRESSION</calc>` in text, in order, stripped of surrounding whitespace.
    An opening tag without its closing one is no call."""
    return [match.group(1).strip() for match in _CALL.finditer(text)]


def calculate(expression: str) -> str:
    """evaluate(expression) written for the model: an integer (or an integral float below 2**53) without ".0",
    any other float with 12 significant digits ("0.3" for 0.1 + 0.2). Raises CalculatorError."""
    value = evaluate(expression)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def evaluate(expression: str) -> int | float:
    """The value of expression, as Python would compute it (an int or a float). Raises CalculatorError."""
    if not isinstance(expression, str):
        raise TypeError(f"calculator expression must be a str, got {type(expression).__name__}")
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(
            f"expression longer than {MAX_LENGTH} characters", expression[MAX_LENGTH:][:10], MAX_LENGTH
        )
    parser = _Parser(expression)
    value = parser.expr(0)
    kind, text, position = parser.peek()
    if kind != "end":
        raise CalculatorError("unexpected " + ("closing parenthesis" if text == ")" else kind), text, position)
    return value


class _Parser:
    """Recursive descent over Python's grammar of arithmetic, computing as it goes:
    expr := term (('+'|'-') term)* ; term := factor (('*'|'/'|'//'|'%') factor)* ;
    factor := ('+'|'-') factor | power ; power := primary ['**' factor] ;
    primary := NUMBER | '(' expr ')' | FUNCTION '(' expr ')'."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.position = 0  # where the next token starts (or whitespace before it)
        self.current: tuple[str, str, int] | None = None

    def peek(self) -> tuple[str, str, int]:
        """The next token as (kind, text, position), kind one of number, name, op, end. Tokens are read as the
        parser asks for them, so the first error reported is the leftmost one."""
        if self.current is None:
            self.current = self._read()
        return self.current

    def take(self) -> tuple[str, str, int]:
        token = self.peek()
        self.current = None
        return token

    def _read(self) -> tuple[str, str, int]:
        text = self.text
        match = _TOKEN.match(text, self.position)
        if match is None:
            start = len(text) - len(text[self.position :].lstrip())
            if start == len(text):
                return ("end", "", len(text))
            hint = " (use ** for powers)" if text[start] == "^" else ""
            raise CalculatorError(f"unexpected character{hint}", text[start], start)
        self.position = match.end()
        kind = match.lastgroup
        return (kind, match.group(kind), match.start(kind))

    def expect_closing(self, opening: int) -> None:
        kind, text, position = self.take()
        if text != ")" or kind != "op":
            if kind == "end":
                raise CalculatorError("parenthesis never closed", "(", opening)
            raise CalculatorError(f"expected ')' (for the '(' at position {opening}), got", text, position)

    def expr(self, depth: int) -> int | float:
        value = self.term(depth)
        while self.peek()[1] in ("+", "-") and self.peek()[0] == "op":
            _, op, position = self.take()
            value = _apply(op, value, self.term(depth), position)
        return value

    def term(self, depth: int) -> int | float:
        value = self.factor(depth)
        while self.peek()[1] in ("*", "/", "//", "%") and self.peek()[0] == "op":
            _, op, position = self.take()
            value = _apply(op, value, self.factor(depth), position)
        return value

    def factor(self, depth: int) -> int | float:
        kind, text, position = self.peek()
        if kind == "op" and text in ("+", "-"):
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"nested deeper than {MAX_DEPTH}", text, position)
            self.take()
            value = self.factor(depth + 1)
            return _checked(-value if text == "-" else +value, text, position)
        return self.power(depth)

    def power(self, depth: int) -> int | float:
        base = self.primary(depth)
        if self.peek()[1] == "**" and self.peek()[0] == "op":
            _, op, position = self.take()
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"nested deeper than {MAX_DEPTH}", op, position)
            exponent = self.factor(depth + 1)
            return _apply(op, base, exponent, position)
        return base

    def primary(self, depth: int) -> int | float:
        kind, text, position = self.take()
        if kind == "number":
            return _literal(text, position)
        if kind == "op" and text == "(":
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"nested deeper than {MAX_DEPTH}", text, position)
            value = self.expr(depth + 1)
            self.expect_closing(position)
            return value
        if kind == "name":
            if text not in FUNCTIONS:
                raise CalculatorError(f"unknown name (the functions are {', '.join(FUNCTIONS)})", text, position)
            opening = self.take()
            if opening[1] != "(":
                raise CalculatorError(f"expected '(' after {text}, got", opening[1], opening[2])
            if depth >= MAX_DEPTH:
                raise CalculatorError(f"nested deeper than {MAX_DEPTH}", opening[1], opening[2])
            argument = self.expr(depth + 1)
            self.expect_closing(opening[2])
            return _call(text, argument, position)
        if kind == "end":
            raise CalculatorError("expression ends where a number was expected", text, position)
        raise CalculatorError("expected a number, got", text, position)


def _literal(text: str, position: int) -> int | float:
    if any(c in text for c in ".eE"):
        return _checked(float(text), text, position)
    if len(text) > MAX_INT_BITS // 3 + 1:  # a longer literal has more than MAX_INT_BITS bits; int() would parse it
        raise CalculatorError(f"integer of more than {MAX_INT_BITS} bits", text[:20], position)
    return _checked(int(text), text, position)


def _apply(op: str, left: int | float, right: int | float, position: int) -> int | float:
    big_power = op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1
    if big_power and (abs(left).bit_length() - 1) * right > MAX_INT_BITS:  # a lower bound of the result's bits
        raise CalculatorError(f"result of more than {MAX_INT_BITS} bits", op, position)
    try:
        if op == "+":
            value = left + right
        elif op == "-":
            value = left - right
        elif op == "*":
            value = left * right
        elif op == "/":
            value = left / right
        elif op == "//":
            value = left // right
        elif op == "%":
            value = left % right
        else:
            value = left**right
    except ZeroDivisionError:
        raise CalculatorError("division by zero", op, position) from None
    except OverflowError:
        raise CalculatorError("result out of range", op, position) from None
    return _checked(value, op, position)


def _call(name: str, argument: int | float, position: int) -> int | float:
    try:
        value = FUNCTIONS[name](argument)
    except ValueError:
        raise CalculatorError("not a real number", name, position) from None
    except OverflowError:
        raise CalculatorError("result out of range", name, position) from None
    return _checked(value, name, position)


def _checked(value: object, token: str, position: int) -> int | float:
    """value, if it is a real number within the bounds; a CalculatorError naming token otherwise."""
    if isinstance(value, complex):
        raise CalculatorError("not a real number", token, position)
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result out of range", token, position)
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result of more than {MAX_INT_BITS} bits", token, position)
    return value
