plain() {  # drop ANSI colour codes: Flower colours its log lines
  "$BIN/python" -u -c 'import re, sys
for line in iter(sys.stdin.readline, ""):
    sys.stdout.write(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line))
    sys.stdout.flush()'
}
