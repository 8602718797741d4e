#!/usr/bin/env python3
"""Writes the ubiqfs(1) man page to stdout from the binary's own command tree.

    scripts/gen-manpage.py .build/debug/ubiqfs > docs/ubiqfs.1

Every command, argument and option comes from `ubiqfs --experimental-dump-help` (the
swift-argument-parser description the --help output is made from), so the page lists exactly
what the binary parses. The prose sections around it are below. Tests/integration/test_cli.py
checks that docs/ubiqfs.1 is what this script makes.
"""

from __future__ import annotations

import json
import subprocess
import sys

DESCRIPTION = """\
ubiqfs gives Linux iCloud-style synced folders. \\fBubiqfs mount\\fR mounts a ubiquity container
(a FUSE file system) whose files sync with a cloud: the embedded engine on this machine, or a
\\fBubiqfs serve\\fR server account signed in with \\fBubiqfs account login\\fR.
Every item's metadata is always local; content may be evicted and downloads on first read.
Changes upload in the background; \\fBubiqfs status\\fR and \\fBubiqfs sync \\-\\-wait\\fR tell
when they have reached the cloud.
"""

CRASH = """\
If a mount daemon dies without unmounting (it was killed, or crashed), the kernel keeps the
mount and every access to it fails with \\(lqTransport endpoint is not connected\\(rq (ENOTCONN;
some kernels say \\(lqSoftware caused connection abort\\(rq, ECONNABORTED).
\\fBubiqfs status\\fR then reports \\(lqdaemon crashed\\(rq with the command to run.
\\fBubiqfs mount\\fR on such a mount point detaches the stale mount lazily (as
\\fBfusermount3 \\-uz\\fR does), says so in one line, and mounts again; nothing closed before
the crash is lost, and queued uploads resume. Mounting the container at another mount point
detaches the old stale one too. \\fBubiqfs unmount\\fR also clears a stale mount.
The systemd user unit \\fBubiqfs@.service\\fR restarts the daemon after a crash
(\\fBRestart=on\\-failure\\fR), which recovers the same way.
"""

ENVIRONMENT = [
    ("UBIQFS_STATE_DIR", "Folder for local state (default \\fI$XDG_DATA_HOME/ubiqfs\\fR or \\fI~/.local/share/ubiqfs\\fR); \\fB\\-\\-state\\-dir\\fR overrides it."),
    ("UBIQFS_CLOUD_DIR", "Folder of the embedded cloud (default \\fI<state dir>/cloud\\fR); \\fB\\-\\-cloud\\-dir\\fR overrides it."),
]

FILES = [
    ("<state dir>/accounts/<account>/<container>/", "Index (\\fIindex.sqlite\\fR), content cache, key-value mirror (\\fIkv.sqlite\\fR)."),
    ("<state dir>/accounts/<account>/<container>/daemon.log", "The mount daemon's log."),
    ("<state dir>/accounts/<account>/<container>/daemon.json", "The running daemon's pid and mount point."),
    ("<state dir>/account.json", "The signed-in server account and this device's token (mode 0600)."),
]

EXAMPLES = [
    ("Mount the default container and wait until a new file is in the cloud:",
     ["ubiqfs mount ~/iCloud", "cp report.pdf ~/iCloud/Documents/", "ubiqfs sync \\-\\-wait ~/iCloud"]),
    ("Free local space, keep one folder always available:",
     ["ubiqfs evict ~/iCloud/Documents/videos", "ubiqfs pin ~/iCloud/Documents/notes"]),
    ("After a daemon crash:", ["ubiqfs status", "ubiqfs mount iCloud.default ~/iCloud"]),
]


def esc(text: str) -> str:
    """Roff-escapes plain text (backslashes and hyphens; a leading dot or quote is protected)."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in out.split("\n"):
        if line.startswith((".", "'")):
            line = "\\&" + line
        lines.append(line)
    return "\n".join(lines)


def arg_label(arg: dict) -> str:
    """How an argument reads in a synopsis: --name <value>, --flag or <value>."""
    value = arg.get("valueName") or "value"
    if arg["kind"] == "positional":
        label = f"\\fI<{esc(value)}>\\fR"
    else:
        name = arg.get("preferredName") or (arg.get("names") or [{}])[0]
        dash = "-" if name.get("kind") in ("short", "longWithSingleDash") else "--"
        label = f"\\fB{esc(dash + name['name'])}\\fR"
        if arg["kind"] == "option":
            label += f" \\fI<{esc(value)}>\\fR"
    if arg.get("isRepeating"):
        label += " ..."
    return label


def names_label(arg: dict) -> str:
    """Every spelling of an option or flag, e.g. -f, --foreground."""
    if arg["kind"] == "positional":
        return arg_label(arg)
    parts = []
    for n in arg.get("names") or []:
        dash = "-" if n["kind"] in ("short", "longWithSingleDash") else "--"
        parts.append(f"\\fB{esc(dash + n['name'])}\\fR")
    label = ", ".join(parts)
    if arg["kind"] == "option":
        label += f" \\fI<{esc(arg.get('valueName') or 'value')}>\\fR"
    return label


def visible_args(cmd: dict) -> list[dict]:
    """The arguments --help shows, without the built-in -h/--help and --version."""
    def builtin(a: dict) -> bool:
        return a["kind"] == "flag" and any(n["name"] in ("h", "help", "version") for n in a.get("names") or [])

    return [a for a in cmd.get("arguments") or [] if a.get("shouldDisplay", True) and not builtin(a)]


def command_section(cmd: dict, path: list[str], out: list[str]) -> None:
    out.append(f'.SS "ubiqfs {esc(" ".join(path))}"')
    synopsis = [f"\\fBubiqfs {esc(' '.join(path))}\\fR"]
    subs = [s for s in cmd.get("subcommands") or [] if s["commandName"] != "help"]
    if subs:
        synopsis.append("\\fI<subcommand>\\fR")
    args = visible_args(cmd)
    for a in args:
        if a["kind"] == "positional":
            label = arg_label(a)
            synopsis.append(f"[{label}]" if a.get("isOptional") else label)
    if any(a["kind"] != "positional" for a in args):
        synopsis.append("[\\fIoptions\\fR]")
    out.append(".PP")
    out.append(" ".join(synopsis))
    if cmd.get("abstract"):
        out.append(".PP")
        out.append(esc(cmd["abstract"]))
    if cmd.get("discussion"):
        out.append(".PP")
        out.append(esc(cmd["discussion"]))
    if subs:
        out.append(".PP")
        out.append("Subcommands: " + ", ".join(f"\\fB{esc(s['commandName'])}\\fR" for s in subs) + ".")
    for a in visible_args(cmd):
        out.append(".TP")
        out.append(names_label(a))
        text = esc(a.get("abstract") or "")
        if a.get("defaultValue") not in (None, "", "false"):
            text += f" (default: {esc(a['defaultValue'])})"
        out.append(text or "\\&")


def walk(cmd: dict, path: list[str], out: list[str]) -> None:
    for sub in cmd.get("subcommands") or []:
        if sub["commandName"] == "help":
            continue
        sub_path = path + [sub["commandName"]]
        command_section(sub, sub_path, out)
        walk(sub, sub_path, out)


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: scripts/gen-manpage.py PATH-TO-UBIQFS > docs/ubiqfs.1", file=sys.stderr)
        return 2
    dump = subprocess.run([sys.argv[1], "--experimental-dump-help"], capture_output=True, text=True, check=True)
    root = json.loads(dump.stdout)["command"]
    out = [
        '.\\" Generated by scripts/gen-manpage.py from `ubiqfs --experimental-dump-help`; do not edit.',
        '.TH UBIQFS 1 "" "ubiqfs" "User Commands"',
        ".SH NAME",
        "ubiqfs \\- " + esc(root.get("abstract") or "iCloud-style ubiquity containers for Linux."),
        ".SH SYNOPSIS",
        "\\fBubiqfs\\fR \\fI<command>\\fR [\\fIarguments\\fR] [\\fIoptions\\fR]",
        ".br",
        "\\fBubiqfs\\fR \\fI<command>\\fR \\fB\\-\\-help\\fR",
        ".SH DESCRIPTION",
        DESCRIPTION.rstrip("\n"),
        ".SH COMMANDS",
    ]
    walk(root, [], out)
    out += [".SH CRASH RECOVERY", CRASH.rstrip("\n"), ".SH ENVIRONMENT"]
    for name, text in ENVIRONMENT:
        out += [".TP", f"\\fB{esc(name)}\\fR", text]
    out.append(".SH FILES")
    for name, text in FILES:
        out += [".TP", f"\\fI{esc(name)}\\fR", text]
    out.append(".SH EXIT STATUS")
    out.append("0 on success; 1 when the command failed (one \\(lqubiqfs: ...\\(rq line on standard error says why"
               " and what to run); 64 for usage errors.")
    out.append(".SH EXAMPLES")
    for text, lines in EXAMPLES:
        out += [".PP", esc(text), ".PP", ".nf", ".RS 4"] + lines + [".RE", ".fi"]
    out += [
        ".SH SHELL COMPLETION",
        "\\fBubiqfs \\-\\-generate\\-completion\\-script\\fR \\fIbash\\fR|\\fIzsh\\fR|\\fIfish\\fR prints a"
        " completion script; \\fIscripts/setup.sh\\fR installs them when run as root.",
        ".SH SEE ALSO",
        "\\fBfusermount3\\fR(1), \\fBgetfattr\\fR(1), \\fBsetfattr\\fR(1), \\fBsystemd.service\\fR(5);"
        " \\fIdocs/user\\-guide.md\\fR in the source tree.",
    ]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
