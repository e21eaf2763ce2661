"""Synthetic Kimi K2 chats for the demo corpus, generated from templates by a seeded RNG.

Each chat is rendered with our chat template (`KIMI_K2_CHAT_TEMPLATE`, `preserve_thinking=True` so every
assistant turn keeps its `<think>...</think>` reasoning). Topics: writing small Python functions, explaining
standard-library functions, summarising prose, arithmetic, unit conversions, list and string operations,
and tool use (tool declarations, Kimi-format tool calls, `## Return of` results, a final answer). About
one assistant turn in eight has thinking off (an empty `<think></think>`), as when a client disables it.
"""

from __future__ import annotations

import ast
import json
import random
import re
from collections.abc import Iterator

from ddtree.tokenization.chat_template import ChatTemplate
from ddtree.tokenization.default_tokenizer import KIMI_K2_CHAT_TEMPLATE

SYSTEM_PROMPTS = (
    None,
    None,
    None,  # None = the template's default system prompt
    "You are a helpful assistant.",
    "You are a concise assistant. Answer briefly.",
    "You are an expert Python programmer. Answer with working code.",
    "You are a patient tutor who explains each step.",
)

# ---- small Python functions: (request, name, code, explanation) ----------------------------------------
FUNCTIONS = (
    (
        "returns the n-th Fibonacci number",
        "fibonacci",
        "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
        "It keeps the last two numbers of the sequence and advances them n times, "
        "so it runs in O(n) time and O(1) memory.",
    ),
    (
        "computes the factorial of n",
        "factorial",
        "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n",
        "It multiplies the numbers from 2 to n; factorial(0) and factorial(1) are both 1.",
    ),
    (
        "checks whether a number is prime",
        "is_prime",
        "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n"
        "            return False\n        i += 1\n    return True\n",
        "It tries every divisor up to the square root of n; if none divides n, the number is prime.",
    ),
    (
        "reverses a string",
        "reverse_string",
        "def reverse_string(s):\n    return s[::-1]\n",
        "The slice s[::-1] walks the string from the end to the start with a step of -1.",
    ),
    (
        "returns the greatest common divisor of two integers",
        "gcd",
        "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return abs(a)\n",
        "This is Euclid's algorithm: replace (a, b) by (b, a mod b) until b is zero.",
    ),
    (
        "counts the words in a text",
        "count_words",
        "def count_words(text):\n    return len(text.split())\n",
        "str.split() without arguments splits on any run of whitespace, so the length of the list is the word count.",
    ),
    (
        "flattens a list of lists",
        "flatten",
        "def flatten(lists):\n    return [item for sub in lists for item in sub]\n",
        "The nested comprehension visits each sub-list and then each item in it, in order.",
    ),
    (
        "removes duplicates from a list while keeping the order",
        "unique",
        "def unique(items):\n    seen = set()\n    result = []\n    for item in items:\n        if item not in seen:\n"
        "            seen.add(item)\n            result.append(item)\n    return result\n",
        "A set remembers what was already seen, and the list keeps the first occurrence of each item in order.",
    ),
    (
        "checks whether a string is a palindrome",
        "is_palindrome",
        "def is_palindrome(s):\n    s = ''.join(c.lower() for c in s if c.isalnum())\n    return s == s[::-1]\n",
        "It keeps only letters and digits in lower case, then compares the string with its reverse.",
    ),
    (
        "returns the sum of the digits of a number",
        "digit_sum",
        "def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n",
        "It turns the number into a string and adds up the value of each digit.",
    ),
    (
        "merges two sorted lists into one sorted list",
        "merge_sorted",
        "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
        "            result.append(a[i])\n            i += 1\n        else:\n"
        "            result.append(b[j])\n            j += 1\n"
        "    result.extend(a[i:])\n    result.extend(b[j:])\n    return result\n",
        "Two indexes walk both lists; the smaller head is appended each time, then the rest of either list is added.",
    ),
    (
        "performs binary search on a sorted list",
        "binary_search",
        "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
        "    while lo <= hi:\n        mid = (lo + hi) // 2\n"
        "        if items[mid] == target:\n            return mid\n"
        "        if items[mid] < target:\n            lo = mid + 1\n"
        "        else:\n            hi = mid - 1\n    return -1\n",
        "Each step halves the search range, so it needs O(log n) comparisons; it returns -1 when the target is absent.",
    ),
    (
        "counts how often each character occurs in a string",
        "char_counts",
        "def char_counts(s):\n    counts = {}\n    for c in s:\n"
        "        counts[c] = counts.get(c, 0) + 1\n    return counts\n",
        "A dictionary maps each character to its count; dict.get supplies 0 the first time a character is seen.",
    ),
    (
        "converts a temperature from Celsius to Fahrenheit",
        "celsius_to_fahrenheit",
        "def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n",
        "The formula is F = C * 9/5 + 32.",
    ),
    (
        "returns the largest element of a list",
        "largest",
        "def largest(items):\n    best = items[0]\n    for item in items[1:]:\n"
        "        if item > best:\n            best = item\n    return best\n",
        "It keeps the best value seen so far and replaces it whenever a larger one appears.",
    ),
    (
        "reads a text file and returns its lines",
        "read_lines",
        "def read_lines(path):\n    with open(path, encoding='utf-8') as f:\n        return f.read().splitlines()\n",
        "The with statement closes the file, and splitlines() drops the line endings.",
    ),
    (
        "sorts a list of dictionaries by a key",
        "sort_by_key",
        "def sort_by_key(records, key):\n    return sorted(records, key=lambda r: r[key])\n",
        "sorted() returns a new list; the lambda tells it which field to compare.",
    ),
    (
        "returns the n-th triangular number",
        "triangular",
        "def triangular(n):\n    return n * (n + 1) // 2\n",
        "The sum 1 + 2 + ... + n equals n(n + 1)/2, and integer division keeps the result an int.",
    ),
    (
        "splits a list into chunks of size n",
        "chunks",
        "def chunks(items, n):\n    return [items[i:i + n] for i in range(0, len(items), n)]\n",
        "range steps through the start index of each chunk, and slicing takes up to n items from there.",
    ),
    (
        "counts the vowels in a string",
        "count_vowels",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n",
        "It lowercases the string and counts the characters that are one of a, e, i, o, u.",
    ),
)
REQUEST_FORMS = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}, and explain it briefly.",
    "Can you write a function in Python that {task}?",
    "I need a Python function that {task}.",
    "Show me how to write a Python function that {task}.",
    "Please implement a function that {task}.",
)

# ---- tools --------------------------------------------------------------------------------------------
CITIES = (
    "Paris",
    "Tokyo",
    "Berlin",
    "Lima",
    "Oslo",
    "Cairo",
    "Toronto",
    "Sydney",
    "Madrid",
    "Seoul",
    "Nairobi",
    "Boston",
    "Dublin",
    "Mumbai",
    "Beijing",
    "Rome",
    "Vienna",
    "Denver",
    "Lagos",
    "Prague",
)
WEATHER = ("sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "partly cloudy")
CURRENCIES = (("USD", 1.0), ("EUR", 0.92), ("GBP", 0.79), ("JPY", 151.0), ("CNY", 7.2), ("CHF", 0.88))
TOOLS = {
    "get_weather": {
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    "calculator": {
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. 2 * (3 + 4)"}},
            "required": ["expression"],
        },
    },
    "convert_currency": {
        "description": "Convert an amount of money between currencies.",
        "parameters": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
            "required": ["amount", "from", "to"],
        },
    },
    "search_docs": {
        "description": "Search the Python documentation.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
    "get_time": {
        "description": "Get the current local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _tool_spec(name: str) -> dict:
    return {"type": "function", "function": {"name": name, **TOOLS[name]}}


def _turn(reasoning: str, content: str, thinking: bool, tool_calls: list | None = None) -> dict:
    m = {"role": "assistant", "content": content, "reasoning_content": reasoning if thinking else ""}
    if tool_calls:
        m["tool_calls"] = [
            {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in tool_calls
        ]
    return m


class _Gen:
    def __init__(self, seed: int, functions: list[tuple[str, str, str]], paragraphs: list[str]):
        self.rng = random.Random(seed)
        self.functions = functions
        self.paragraphs = paragraphs

    def thinking(self) -> bool:
        return self.rng.random() >= 0.125

    # each topic returns (messages after the system prompt, tool names)
    def write_function(self):
        task, name, code, why = self.rng.choice(FUNCTIONS)
        q = self.rng.choice(REQUEST_FORMS).format(task=task)
        reasoning = (
            f"The user wants a function that {task}. I will call it {name}, keep it simple and "
            f"explain how it works. {why}"
        )
        answer = f"Here is a function that {task}:\n\n```python\n{code}```\n\n{why}"
        if self.rng.random() < 0.5:
            answer += f"\n\nExample: `{name}(...)` can be called directly after defining it."
        return [{"role": "user", "content": q}, _turn(reasoning, answer, self.thinking())], []

    def explain_function(self):
        if not self.functions:
            return self.write_function()
        name, src, summary = self.rng.choice(self.functions)
        q = self.rng.choice(
            ("What does this function do?", "Explain this Python code.", "Can you summarise what this function does?")
        )
        reasoning = (
            f"This is a function called {name}. Reading its body and docstring: {summary} "
            "I should describe its purpose in plain words."
        )
        answer = f"The function `{name}` does the following: {summary}"
        user = {"role": "user", "content": f"{q}\n\n```python\n{src}```"}
        return [user, _turn(reasoning, answer, self.thinking())], []

    def summarise(self):
        if not self.paragraphs:
            return self.arithmetic()
        para = self.rng.choice(self.paragraphs)
        first = re.split(r"(?<=[.!?])\s", para, maxsplit=1)[0]
        q = self.rng.choice(
            (
                "Summarize the following text in one sentence:",
                "What is the main point of this passage?",
                "Give a one-line summary of this text:",
            )
        )
        reasoning = "The passage is mostly about what its first sentence says, so the summary can follow it closely."
        return [{"role": "user", "content": f"{q}\n\n{para}"}, _turn(reasoning, first, self.thinking())], []

    def arithmetic(self):
        r = self.rng
        a, b, c = r.randint(2, 99), r.randint(2, 99), r.randint(2, 20)
        op = r.choice("+-*")
        if op == "*":
            tens, ones = b // 10 * 10, b % 10
            steps = f"{a} * {b} = {a} * {tens} + {a} * {ones} = {a * tens} + {a * ones} = {a * b}."
            value = a * b
        else:
            value = a + b if op == "+" else a - b
            steps = f"{a} {op} {b} = {value}."
        if r.random() < 0.4:
            steps += f" Then adding {c} gives {value} + {c} = {value + c}."
            q, value = f"What is {a} {op} {b} + {c}?", value + c
        else:
            q = r.choice((f"What is {a} {op} {b}?", f"Compute {a} {op} {b}.", f"Calculate {a} {op} {b}, please."))
        reasoning = f"Let me compute step by step. {steps}"
        return [{"role": "user", "content": q}, _turn(reasoning, f"The answer is {value}.", self.thinking())], []

    def convert_units(self):
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:
            x = r.randint(1, 500)
            return self._conv(
                f"How many miles is {x} kilometers?",
                f"1 km is 0.621371 miles, so {x} km is {x} * 0.621371 = {x * 0.621371:.2f} miles.",
                f"{x} km is about {x * 0.621371:.2f} miles.",
            )
        if kind == 1:
            x = r.randint(-30, 45)
            f = x * 9 / 5 + 32
            return self._conv(
                f"Convert {x} degrees Celsius to Fahrenheit.",
                f"F = C * 9/5 + 32 = {x} * 9/5 + 32 = {f:g}.",
                f"{x} °C is {f:g} °F.",
            )
        if kind == 2:
            x = r.randint(1, 200)
            return self._conv(
                f"How many pounds are {x} kilograms?",
                f"1 kg is 2.20462 lb, so {x} kg is {x * 2.20462:.2f} lb.",
                f"{x} kg is about {x * 2.20462:.1f} pounds.",
            )
        if kind == 3:
            x = r.randint(1, 48)
            return self._conv(
                f"How many minutes are in {x} hours?",
                f"Each hour has 60 minutes: {x} * 60 = {x * 60}.",
                f"There are {x * 60} minutes in {x} hours.",
            )
        x = r.randint(1, 64)
        return self._conv(
            f"How many bytes are in {x} KiB?",
            f"1 KiB is 1024 bytes, so {x} KiB is {x} * 1024 = {x * 1024}.",
            f"{x} KiB is {x * 1024} bytes.",
        )

    def _conv(self, q, reasoning, answer):
        return [{"role": "user", "content": q}, _turn(reasoning, answer, self.thinking())], []

    def list_op(self):
        r = self.rng
        xs = [r.randint(0, 99) for _ in range(r.randint(4, 9))]
        ops = (
            ("Sort this list in ascending order", lambda: sorted(xs), "Sorting the numbers from smallest to largest"),
            (
                "What is the largest number in this list",
                lambda: max(xs),
                "Comparing each number with the largest so far",
            ),
            (
                "What is the smallest number in this list",
                lambda: min(xs),
                "Comparing each number with the smallest so far",
            ),
            (
                "What is the sum of this list",
                lambda: sum(xs),
                "Adding the numbers one by one: " + " + ".join(map(str, xs)),
            ),
            ("Reverse this list", lambda: xs[::-1], "Reading the list from the end to the start"),
            (
                "Which numbers in this list are even",
                lambda: [x for x in xs if x % 2 == 0],
                "Keeping the numbers divisible by 2",
            ),
            ("How many items are in this list", lambda: len(xs), "Counting the items"),
        )
        q, fn, how = r.choice(ops)
        result = fn()
        return [
            {"role": "user", "content": f"{q}: {xs}"},
            _turn(f"{how} gives {result}.", f"The result is {result}.", self.thinking()),
        ], []

    def string_op(self):
        r = self.rng
        word = r.choice(
            (
                "python",
                "speculative",
                "decoding",
                "banana",
                "attention",
                "mixture",
                "expert",
                "latent",
                "tokenizer",
                "gateway",
                "verifier",
                "drafter",
                "kimi",
                "deepseek",
            )
        )
        ops = (
            ("Write the word '{w}' in upper case.", word.upper(), "str.upper() turns every letter into a capital"),
            ("Reverse the string '{w}'.", word[::-1], "Reading the letters from last to first"),
            ("How many letters does '{w}' have?", str(len(word)), "Counting the letters one by one"),
            ("How many vowels are in '{w}'?", str(sum(c in "aeiou" for c in word)), "Counting a, e, i, o and u"),
        )
        q, a, how = r.choice(ops)
        return [
            {"role": "user", "content": q.format(w=word)},
            _turn(f"{how}: the answer is {a}.", f"The answer is {a}.", self.thinking()),
        ], []

    def tool_use(self):
        r = self.rng
        kind = r.randrange(5)
        if kind == 0:
            cities = r.sample(CITIES, r.choice((1, 1, 2)))
            unit = r.choice(("celsius", "fahrenheit"))
            calls = [("get_weather", {"city": c, "unit": unit}) for c in cities]
            temps = [r.randint(-5, 35) if unit == "celsius" else r.randint(25, 95) for _ in cities]
            skies = [r.choice(WEATHER) for _ in cities]
            results = [
                json.dumps({"city": c, "temperature": t, "unit": unit, "conditions": s})
                for c, t, s in zip(cities, temps, skies)
            ]
            sym = "°C" if unit == "celsius" else "°F"
            q = f"What's the weather like in {' and '.join(cities)}?"
            q += " Use fahrenheit." if unit == "fahrenheit" else ""
            final = " ".join(f"In {c} it is {t}{sym} and {s}." for c, t, s in zip(cities, temps, skies))
            why = "I need the current weather, so I will call get_weather"
            why += " for each city." if len(cities) > 1 else "."
        elif kind == 1:
            a, b, c = r.randint(10, 999), r.randint(10, 999), r.randint(2, 30)
            expr = f"({a} + {b}) * {c}"
            calls, results = [("calculator", {"expression": expr})], [json.dumps({"result": (a + b) * c})]
            q = f"Use the calculator to compute {expr}."
            final, why = f"{expr} = {(a + b) * c}.", "The user asks for a calculation; the calculator tool is exact."
        elif kind == 2:
            (src, rs), (dst, rd) = r.sample(CURRENCIES, 2)
            amount = r.randint(5, 2000)
            value = round(amount / rs * rd, 2)
            calls = [("convert_currency", {"amount": amount, "from": src, "to": dst})]
            results = [json.dumps({"amount": value, "currency": dst})]
            q, final = f"How much is {amount} {src} in {dst}?", f"{amount} {src} is about {value} {dst}."
            why = "Exchange rates change, so I should use the convert_currency tool."
        elif kind == 3:
            _, name, _, why_fn = r.choice(FUNCTIONS)
            topic = r.choice(
                (
                    "itertools.chain",
                    "functools.lru_cache",
                    "collections.Counter",
                    "pathlib.Path",
                    "json.dumps",
                    "re.sub",
                    "dataclasses.dataclass",
                    "asyncio.gather",
                )
            )
            calls = [("search_docs", {"query": topic})]
            results = [json.dumps({"title": topic, "summary": f"Documentation entry for {topic}."})]
            q = f"Look up {topic} in the Python docs and tell me what it is for."
            final = f"According to the documentation, {topic} is described in its own entry; see the summary above."
            why = "I should search the documentation before answering."
        else:
            city = r.choice(CITIES)
            hh, mm = r.randint(0, 23), r.randint(0, 59)
            calls, results = [("get_time", {"city": city})], [json.dumps({"city": city, "time": f"{hh:02d}:{mm:02d}"})]
            q, final = f"What time is it in {city}?", f"It is {hh:02d}:{mm:02d} in {city}."
            why = "I will call get_time."
        names = sorted({n for n, _ in calls} | set(r.sample(sorted(TOOLS), r.randint(0, 2))))
        msgs = [{"role": "user", "content": q}, _turn(why, "", self.thinking(), calls)]
        msgs[-1]["tool_calls_ids"] = None
        for i, res in enumerate(results):
            msgs.append({"role": "tool", "content": res, "tool_call_id": f"functions.{calls[i][0]}:{i}"})
        msgs.append(_turn("I have the tool results and can answer now.", final, self.thinking()))
        return msgs, names

    def chat(self) -> tuple[list[dict], list[str]]:
        r = self.rng
        topics = (
            (self.write_function, 4),
            (self.explain_function, 3),
            (self.summarise, 2),
            (self.arithmetic, 2),
            (self.convert_units, 1),
            (self.list_op, 2),
            (self.string_op, 1),
            (self.tool_use, 4),
        )
        fns, weights = zip(*topics)
        msgs, tools = [], set()
        system = r.choice(SYSTEM_PROMPTS)
        if system:
            msgs.append({"role": "system", "content": system})
        for _ in range(1 if r.random() < 0.75 else 2):
            turn, names = r.choices(fns, weights)[0]()
            if names and any(m.get("tool_calls") for m in msgs):
                continue  # keep the tool-call ids of one conversation simple
            msgs.extend(turn)
            tools.update(names)
        for m in msgs:
            m.pop("tool_calls_ids", None)
        return msgs, sorted(tools)


def generate(seed: int, functions: list[tuple[str, str, str]] = (), paragraphs: list[str] = ()) -> Iterator[str]:
    """An endless stream of rendered chats; the same seed and inputs give the same stream."""
    template = ChatTemplate(KIMI_K2_CHAT_TEMPLATE)
    gen = _Gen(seed, list(functions), list(paragraphs))
    while True:
        msgs, tools = gen.chat()
        yield template.render(
            msgs, tools=[_tool_spec(n) for n in tools] or None, add_generation_prompt=False, preserve_thinking=True
        )


def functions_from_sources(sources: list[str], limit: int = 3000) -> list[tuple[str, str, str]]:
    """(name, source, first docstring sentence) of short documented top-level functions, in source order."""
    out = []
    for src in sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        lines = src.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if not doc or n > 25 or node.col_offset:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            out.append((node.name, "".join(lines[node.lineno - 1 : node.end_lineno]), summary))
            if len(out) >= limit:
                return out
    return out


def paragraphs_from_prose(docs: list[str], limit: int = 5000) -> list[str]:
    out = []
    for d in docs:
        for para in d.split("\n\n"):
            para = " ".join(para.split())
            if 200 <= len(para) <= 900 and para[0].isupper() and para.endswith("."):
                out.append(para)
                if len(out) >= limit:
                    return out
    return out
