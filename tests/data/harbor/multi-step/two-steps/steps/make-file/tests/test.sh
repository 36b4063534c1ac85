#!/bin/bash
bash /tests/reward.sh one
