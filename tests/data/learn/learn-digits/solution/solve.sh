#!/bin/bash
printf 12345678 > answer.txt
