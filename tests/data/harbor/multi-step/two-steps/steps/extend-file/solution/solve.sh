#!/bin/bash
echo two >> step.txt
