/* The ABI-6 record indices and kinds that gate.c reads, copied from ranks/contract/abi6.py
 * (the definition). tests/unit/ranks/test_abi6_header.py compares every value here with it,
 * so the two cannot drift apart. */
#ifndef HELIOS_ABI6_H
#define HELIOS_ABI6_H

#define SLOT 0
#define EPOCH 1
#define KIND 3
#define EMITTED 4
#define FORCED_MASK 5
#define FIRST_LOGIT_ROW 11
#define HEADER 16
#define KIND_SAMPLE 1
#define KIND_SPECULATIVE 2

#endif
