@@# The same files fedciuic.data.corpus reads: *.jsonl and *.txt, hidden entries skipped.
if [ -z "$(find @@{data} -mindepth 1 -name '.*' -prune -o \( -type f -o -type l \) \( -name '*.jsonl' -o -name '*.txt' \) -print -quit)" ]; then
  echo @@{message} >&2
  exit 1
fi
