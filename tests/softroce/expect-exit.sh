#!/usr/bin/env bash
# Exits with the code it is given: proves the harness returns the script's code.
echo "exiting with $1 on purpose"
exit "$1"
