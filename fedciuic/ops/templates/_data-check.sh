@@# The files fedciuic.data.sources reads (a save_to_disk folder holds state.json), hidden
@@# entries skipped; `fedciuic data check` checks what they hold.
if [ -z "$(find @@{data} -mindepth 1 -name '.*' -prune -o \( -type f -o -type l \) \( -name '*.jsonl' -o -name '*.json' -o -name '*.csv' -o -name '*.parquet' -o -name '*.txt' \) -print -quit)" ]; then
  echo @@{message} >&2
  exit 1
fi
