#!/bin/bash
# [environment] workdir: the agent worked, and the tests run, in /custom-workdir.
mkdir -p /logs/verifier
if [ "$(pwd)" = /custom-workdir ] && cmp -s /custom-workdir/data.txt /custom-workdir/out.txt
then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
