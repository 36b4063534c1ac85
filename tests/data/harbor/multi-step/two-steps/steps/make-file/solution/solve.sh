#!/bin/bash
echo one > step.txt
