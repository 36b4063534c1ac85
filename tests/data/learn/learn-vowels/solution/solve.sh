#!/bin/bash
printf aeiouaei > answer.txt
