#!/usr/bin/env bash
# README's recipes give up, rather than hang, when the broker never comes
# up: each recipe named here runs through check-readme-recipe.sh with a
# stand-in `tinybroker` that exits at once, and must fail with the recipe's
# own line (`gave up after N s: ... did not answer /readyz ...`) within its
# bound N plus 10 s, well inside the checker's 60 s.
#
#   bash scripts/check-readme-recipe-bound.sh [RECIPE...]   (default: quick-start local-cluster)
set -euo pipefail
cd "$(dirname "$0")/.."
recipes=("$@")
[ ${#recipes[@]} -gt 0 ] || recipes=(quick-start local-cluster)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
printf '#!/bin/sh\necho "stand-in tinybroker: exits at once, as a broker that cannot start" >&2\nexit 1\n' > "$dir/tinybroker"
chmod +x "$dir/tinybroker"
failures=0
for recipe in "${recipes[@]}"; do
    started=$SECONDS
    status=0
    TINYBROKER_BIN=$dir/tinybroker bash scripts/check-readme-recipe.sh "$recipe" out.txt 'never written' \
        > "$dir/$recipe.out" 2>&1 || status=$?
    took=$((SECONDS - started))
    kept=$(sed -nE 's/.*its directory is kept: ([^)]*)\).*/\1/p' "$dir/$recipe.out")
    [ -z "$kept" ] || rm -rf "$kept"
    said=$(grep -oE 'gave up after [0-9]+ s: .*did not answer /readyz.*' "$dir/$recipe.out" | head -n1 || true)
    bound=$(sed -E 's/^gave up after ([0-9]+) s.*/\1/' <<< "$said")
    if [ "$status" -eq 0 ]; then
        problem="passed with a broker that exits at once"
    elif [ -z "$said" ]; then
        problem="failed without saying it gave up on /readyz"
    elif [ "$took" -gt $((bound + 10)) ]; then
        problem="took $took s to give up, more than its bound $bound s + 10 s"
    else
        echo "README's recipe $recipe, broker never up: gave up in $took s, as it should: $said"
        continue
    fi
    echo "--- check-readme-recipe.sh $recipe with a broker that exits at once:"
    cat "$dir/$recipe.out"
    echo "README's recipe $recipe, broker never up: $problem (after $took s)" >&2
    failures=$((failures + 1))
done
[ "$failures" -eq 0 ]
