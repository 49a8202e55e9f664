@@# `plain [FILE]`: stdin to stdout (and appended to FILE) without ANSI colour codes
@@# (Flower colours its log lines). A closed stdout (its reader gone: a `| head`, a
@@# `| tee` that Ctrl-C stopped) is dropped, never an error: FILE still gets every
@@# line, and what writes into the filter is not stopped by it.
plain() {  # drop ANSI colour codes: Flower colours its log lines
  "$BIN/python" -u -c 'import os, re, sys
colour = re.compile(rb"\x1b\[[0-9;?]*[A-Za-z]")
copy = open(sys.argv[1], "ab") if len(sys.argv) > 1 else None
out = sys.stdout.buffer
for line in iter(sys.stdin.buffer.readline, b""):
    line = colour.sub(b"", line)
    if copy is not None:
        copy.write(line)
        copy.flush()
    if out is not None:
        try:
            out.write(line)
            out.flush()
        except OSError:  # the reader is gone: keep reading, write nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            out = None' "$@"
}
