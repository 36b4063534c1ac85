#!/bin/bash
bash /tests/reward.sh "$(printf 'one\ntwo')"
