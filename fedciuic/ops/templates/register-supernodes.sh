#!/usr/bin/env bash
# Admit each region's SuperNode (its auth/REGION.auth.pub) to the running SuperLink.
@@{preamble}
@@{registrations}
