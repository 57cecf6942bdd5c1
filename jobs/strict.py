"""What a command's parser did not take: Beam's options, the positional OUT, or an error.

A command that runs a Beam pipeline (``run``, ``plan``, ``collect``, ``submit``) hands the
flags it does not know to Beam as PipelineOptions. Beam itself only warns about an option it
does not know ("Discarding unparseable args") and runs without it, so a typo such as
``--guidence-scale 0`` would silently run with the default. ``check_extra`` refuses such a flag
before anything runs: a flag is accepted only if the command or Beam's PipelineOptions define
it, exactly (an abbreviation of either is refused), a Beam option that takes one value is given
once, and the error names the closest flag, the command's own before Beam's.

Every command that works on one run takes its OUT either way, ``promptmill status OUT`` or
``promptmill status --out OUT`` (``take_out``); ``reproduce``, whose positional arguments are
image keys, takes ``--out`` alone.
"""
from __future__ import annotations

import argparse
import difflib
import functools
import shlex

from jobs.flags import given, given_twice


def strict(parser: argparse.ArgumentParser, beam: bool = False, beam_strings: tuple[str, ...] = (),
           out: bool = False) -> None:
    """Mark ``parser`` (a subcommand's) for ``check_extra``: whether flags it does not know may be
    Beam options (``beam``), which of its flags hold Beam options in one quoted string, and
    whether it takes OUT as its positional argument as well as ``--out`` (``out``). Such a
    command's ``--out`` is required (once as either) unless it has a default."""
    needed = None
    if out:
        [action] = [a for a in parser._actions if "--out" in a.option_strings]
        needed = bool(action.required or action.default is None)
        action.required = False  # either form will do: check_extra says when neither came
        text = action.help or ""
        action.help = text.replace(" (default:", f" ({OUT_BOTH_WAYS}; default:", 1) if " (default:" in text \
            else f"{text} ({OUT_BOTH_WAYS})"
    parser.set_defaults(flags_parser_=parser, flags_beam_=beam, flags_beam_strings_=tuple(beam_strings),
                        flags_out_=needed)


OUT_BOTH_WAYS = "or as the positional OUT"


def show_positional_out(parser: argparse.ArgumentParser) -> None:
    """Name the positional OUT in the usage line of a parser marked ``strict(..., out=True)``;
    called once every flag of it is added (argparse writes the usage from its actions, and the
    positional OUT is none: see ``take_out``)."""
    if parser.get_default("flags_out_") is None:
        return
    usage = parser.format_usage().removeprefix("usage: ").rstrip()
    indent = "\n" + " " * len(f"usage: {parser.prog} ")
    parser.usage = usage.replace(parser.prog, f"{parser.prog} [OUT]", 1).replace(indent, indent + " " * 6)


@functools.lru_cache(maxsize=1)
def _beam_actions() -> dict[str, argparse.Action]:
    """Every option of Beam's PipelineOptions, by flag (``--runner``, ``--experiment``, ...).

    Beam builds its parser from the ``_add_argparse_args`` of every PipelineOptions subclass
    when it reads options; ``get_all_options`` hands that parser to ``add_extra_args_fn``,
    which is how it is caught here rather than rebuilt by hand.
    """
    from apache_beam.options.pipeline_options import PipelineOptions

    caught: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=caught.append)
    # argparse lists a parser's options only in _actions (argparse's own help and usage read it)
    return {flag: action for action in caught[0]._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def beam_option_flags() -> frozenset[str]:
    """The flags Beam's PipelineOptions know, e.g. ``--runner``, ``--direct_num_workers``."""
    return frozenset(_beam_actions())


def _flag_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: action for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


def _looks_like_flag(token: str) -> bool:
    """What argparse takes for a flag rather than a value: a leading '-' that is not a negative number."""
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def _scan(tokens: list[str], known: dict[str, argparse.Action]) -> list[tuple[str, str | None, bool, int]]:
    """(flag or stray value, its value or None, whether it is a stray value, its index) for each of
    ``tokens``.

    ``--name=value`` and ``--name value`` both work. As in argparse, the token after a flag
    that takes a value is its value unless it looks like a flag itself (a negative number is a
    value); an unknown flag is taken to take one. ``--`` ends the options.
    """
    found = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token == "--":
            break
        if not _looks_like_flag(token):
            found.append((token, None, True, i))  # a value with no flag before it
            i += 1
            continue
        name, eq, value = token.partition("=")
        start = i
        action = known.get(name)
        takes_value = action is None or action.nargs != 0  # unknown: a value after it belongs to it
        if not eq:
            value = None
            if takes_value and i + 1 < len(tokens) and not _looks_like_flag(tokens[i + 1]):
                i += 1
                value = tokens[i]
        found.append((name, value, False, start))
        i += 1
    return found


def unknown_flags(tokens: list[str], known: dict[str, argparse.Action]) -> list[str]:
    """The flags among ``tokens`` that ``known`` does not define (exactly: no abbreviations),
    and stray values, in order (``_scan`` says how values are told from flags); an unknown flag
    is taken to take a value, so only the flag is reported."""
    return [name for name, _, stray, _ in _scan(tokens, known) if stray or name not in known]


def repeated_flags(tokens: list[str], known: dict[str, argparse.Action]) -> list[str]:
    """What is wrong with each single-valued flag of ``known`` (a store action of any kind, by
    dest) that ``tokens`` give more than once; flags that accumulate (append) may repeat."""
    first: dict[str, tuple[str, object]] = {}
    problems = []
    for name, value, stray, _ in _scan(tokens, known):
        action = None if stray else known.get(name)
        if not isinstance(action, (argparse._StoreAction, argparse._StoreConstAction)):  # argparse's store actions
            continue
        if action.dest in first:
            problems.append(given_twice(first[action.dest], (name, value), action.nargs == 0))
        else:
            first[action.dest] = (name, value)
    return problems


def _norm(flag: str) -> str:
    """A flag's name as compared for suggestions: no leading dashes, '_' as '-' (Beam's style vs ours)."""
    return flag.lstrip("-").replace("_", "-")


def suggestions(token: str, own: list[str] | tuple = (), beam: list[str] | tuple = ()) -> list[str]:
    """The flags to suggest for the unknown flag ``token``, the command's own (``own``) before
    Beam's (``beam``): the same name with the other word separator (``--job-name`` for Beam's
    ``--job_name``); else the flags it abbreviates (``--ste``: ``--steps``), at most three; else
    the closest name (difflib; an own flag must be closer than a Beam option, so a Beam option
    typed with a typo is not taken for an unrelated flag of ours)."""
    name = _norm(token)
    for pool in (own, beam):
        same = [flag for flag in pool if _norm(flag) == name]
        if same:
            return same[:1]
    if len(name) >= 2:
        for pool in (own, beam):
            longer = [flag for flag in pool if _norm(flag).startswith(name)]
            if longer:
                return longer[:3]
    for pool, cutoff in ((own, 0.7), (beam, 0.6)):
        by_name = {_norm(flag): flag for flag in pool}
        close = difflib.get_close_matches(name, list(by_name), n=1, cutoff=cutoff)
        if close:
            return [by_name[close[0]]]
    return []


def _either(flags: list[str]) -> str:
    return flags[0] if len(flags) == 1 else f"{', '.join(flags[:-1])} or {flags[-1]}"


def _describe(unknown: list[str], own: list[str] | tuple = (), beam: list[str] | tuple = ()) -> str:
    parts = []
    for token in unknown:
        if not _looks_like_flag(token):
            parts.append(repr(token))
            continue
        close = suggestions(token, own, beam)
        parts.append(f"{token} (did you mean {_either(close)}?)" if close else token)
    return ", ".join(parts)


def check_beam_args(tokens: list[str], command: str | None = None, suggest: list[str] | tuple = ()) -> str | None:
    """None if every flag of ``tokens`` is a Beam option, exactly (Beam would refuse an
    abbreviation too, but only warn and drop it), and each single-valued one is given once;
    else what is wrong, for an error message that names the closest flag of ``suggest``
    (``command``'s flags) or Beam option."""
    beam = _beam_actions()
    unknown = unknown_flags(tokens, beam)
    if not unknown:
        repeated = repeated_flags(tokens, beam)
        return "; ".join(repeated) if repeated else None
    one = len(unknown) == 1
    who = f"neither {command} nor Beam's pipeline options know" if command else "Beam's pipeline options do not know"
    return (f"unrecognized argument{'' if one else 's'}: {_describe(unknown, list(suggest), sorted(beam))}; "
            f"{who} {'it' if one else 'them'}")


def check_extra(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The Beam options among ``extra`` (what ``parse_known_args`` left), after checking them.

    A flag the command does not know is an error (argparse's: usage, the message, exit 2)
    unless the command takes Beam options and Beam knows it. The flags that hold Beam options in
    one quoted string (``--plan-beam-args``) are checked by the same rule.
    """
    parser: argparse.ArgumentParser = args.flags_parser_
    own = list(_flag_actions(parser))  # in the order the command defines them
    if args.flags_out_ is not None:
        extra = take_out(parser, args, extra)
    if extra and not args.flags_beam_:
        unknown = unknown_flags(extra, _flag_actions(parser))
        word = "argument" if len(unknown) == 1 else "arguments"
        parser.error(f"unrecognized {word}: {_describe(unknown or extra, own)}")
    if extra:
        problem = check_beam_args(extra, parser.prog, own)
        if problem:
            parser.error(problem)
    for flag in args.flags_beam_strings_:
        value = getattr(args, _flag_actions(parser)[flag].dest)
        if value is None:
            continue
        try:
            tokens = shlex.split(value)
        except ValueError:
            continue  # bad quoting: the command's own error (exit 1), with the value
        problem = check_beam_args(tokens)
        if problem:
            parser.error(f"{flag} {value!r}: {problem}")
    return list(extra)


def take_out(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> list[str]:
    """``extra`` less the positional OUT of a command that takes one (``strict(..., out=True)``),
    which goes to ``args.out``: the first value in ``extra`` that no flag takes. It is not an
    argparse positional, because argparse would give it the value of a Beam option it does not
    know (``--project p``). OUT given both ways must be the same; a command without a default
    OUT that got neither is refused (argparse's usage error, exit 2)."""
    known = {**(_beam_actions() if args.flags_beam_ else {}), **_flag_actions(parser)}
    strays = [index for _, _, stray, index in _scan(extra, known) if stray]
    if strays:
        positional = extra[strays[0]]
        flag = given(args).get("out")
        if flag is not None and flag[1] != positional:
            parser.error(f"OUT given twice, as {positional} and as {flag[0]} {flag[1]}: give it once")
        args.out = positional
        extra = extra[:strays[0]] + extra[strays[0] + 1:]
    elif args.out is None and args.flags_out_:
        parser.error(f"the run's OUT is missing: {parser.prog} OUT, or {parser.prog} --out OUT")
    return extra
