# Sourced by the example scripts: the OUT folder they write everything into.
#
#   prepare_out DIR SCRIPT_NAME
#
# A script empties DIR only when an earlier run of an example script made it (it holds the marker
# file below); an empty DIR is taken as it is. Any other existing DIR is refused in one line,
# exit code 2, with nothing touched: it may hold the user's files.
OUT_MARKER=.seq1f1b-example-output

prepare_out() {
    local out=$1 script=$2
    if [ -e "$out" ] && [ ! -d "$out" ]; then
        echo "$script: error: OUT=$out exists and is not a directory" >&2
        exit 2
    fi
    if [ -d "$out" ] && [ -n "$(ls -A "$out")" ]; then
        if [ ! -f "$out/$OUT_MARKER" ]; then
            echo "$script: error: OUT=$out exists and was not made by an example script (no" \
                 "$OUT_MARKER in it): choose another OUT, or empty it yourself" >&2
            exit 2
        fi
        rm -rf "$out"
    fi
    mkdir -p "$out"
    echo "made by $script; removed by its next run" > "$out/$OUT_MARKER"
}
