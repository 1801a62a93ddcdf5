/* The reduction gate and payload write of ranks/step/reduce.py on host tensors, in C.
 *
 * The record indices (SLOT, EPOCH, ...) come from abi6.h, a copy of ranks/contract/abi6.py
 * that a test compares with it. The gate and the write return 0,
 * or -1 when an index would leave its buffer (the Python caller raises; numpy would have
 * raised IndexError or wrapped a negative index). step_reduce runs both around the kernels'
 * prepared one-rank reduction, in one call from Python.
 */
#include <stdint.h>
#include <string.h>

#include "abi6.h"

/* 1 when bit `at` of the forced mask is set (numpy's >> for shifts past the width). */
static int64_t forced_bit(int64_t mask, int64_t at) {
    return at >= 64 ? (mask < 0) : ((mask >> at) & 1);
}

/* Per row r < rows: requested[r] is 1 when the row passes every condition of the gate
 * (reduce.py's module docstring; its token must be an id in [0, vocab)), chosen[r] the
 * record's token at the clipped position; the slot's selected IDs and count are copied when
 * `ids_src` is not NULL. Padding rows (slot -1) read slot 0, as the tensor form does. */
int gate_rows(const int64_t *records, int64_t capacity, int64_t width,
              const int64_t *row_slots, const int64_t *row_epochs,
              const int64_t *row_positions, int64_t rows, const int32_t *requested_by_slot,
              int32_t *requested, int64_t *chosen,
              const int32_t *ids_src, const int32_t *counts_src, int32_t *ids,
              int32_t *counts, int64_t max_ids, int64_t vocab) {
    int64_t last = width - HEADER - 1;
    for (int64_t r = 0; r < rows; ++r) {
        int64_t wanted = row_slots[r], position = row_positions[r];
        int64_t slot = wanted > 0 ? wanted : 0;
        if (slot >= capacity) return -1;
        int64_t at = position > 0 ? position : 0;
        if (at > last) at = last;
        const int64_t *rec = records + slot * width;
        const int64_t token = rec[HEADER + at];
        int gate = wanted >= 0 && position >= 0 && rec[SLOT] == wanted
            && rec[EPOCH] == row_epochs[r]
            && (rec[KIND] == KIND_SAMPLE || rec[KIND] == KIND_SPECULATIVE)
            && position < rec[EMITTED] && forced_bit(rec[FORCED_MASK], at) == 0
            && rec[FIRST_LOGIT_ROW] + position == r && requested_by_slot[slot] != 0
            && token >= 0 && token < vocab;
        requested[r] = gate;
        chosen[r] = token;
        if (ids_src != NULL) {
            memcpy(ids + r * max_ids, ids_src + slot * max_ids, sizeof(int32_t) * max_ids);
            counts[r] = counts_src[slot];
        }
    }
    return 0;
}

/* Emitted position positions[r] of slot slots[r] gets out[r, :words] for every gated row
 * r < rows; the payload is [capacity, tokens, words], `out` [>= rows, out_width]. */
int write_payload(int32_t *payload, int64_t capacity, int64_t tokens, int64_t words,
                  const int32_t *out, int64_t out_width, const int32_t *requested,
                  const int64_t *slots, const int64_t *positions, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
        if (!requested[r]) continue;
        int64_t slot = slots[r], position = positions[r];
        if (slot < 0 || slot >= capacity || position < 0 || position >= tokens) return -1;
        memcpy(payload + (slot * tokens + position) * words, out + r * out_width,
               sizeof(int32_t) * words);
    }
    return 0;
}

/* The kernels' prepared one-rank reduction (reduce_prepared in kernels/cpu/compiled.c,
 * passed by address with its argument block): the number of rows it left for Python. */
typedef int64_t (*reduce_t)(const void *block, int64_t threads);

/* step_reduce's arguments that stay the same from step to step, prepared once by
 * gate_native.py (StepBlock) and passed by address. */
typedef struct {
    const int64_t *records[2];
    int32_t *payload[2];
    int64_t capacity, width, tokens, words;
    const int32_t *requested_by_slot;
    int32_t *requested;
    int64_t *chosen;
    const int32_t *ids_src, *counts_src;
    int32_t *ids, *counts;
    int64_t max_ids, vocab;
    void *reduce;
    const void *reduce_block;
    const int32_t *out;
    int64_t out_width;
    const int64_t *row_slots, *row_epochs, *row_positions;
} StepBlock;

/* A step's whole reduction at TP1: gate_rows over frame `frame`'s records and the block's
 * row vectors (`rows` entries), the prepared reduction of the gated rows, and write_payload
 * of the first write_rows rows. 0 when done; -1 / -2 when the gate / the write would leave
 * a buffer; 1 when the reduction left rows for Python (nothing written: the caller runs its
 * own path, then the write). */
int step_reduce(const StepBlock *b, int64_t frame, int64_t rows, int64_t write_rows,
                int64_t threads) {
    const int64_t *row_slots = b->row_slots, *row_epochs = b->row_epochs;
    const int64_t *row_positions = b->row_positions;
    if (gate_rows(b->records[frame], b->capacity, b->width, row_slots, row_epochs,
                  row_positions, rows, b->requested_by_slot, b->requested, b->chosen,
                  b->ids_src, b->counts_src, b->ids, b->counts, b->max_ids, b->vocab) != 0)
        return -1;
    if (((reduce_t)b->reduce)(b->reduce_block, threads) != 0) return 1;
    if (write_payload(b->payload[frame], b->capacity, b->tokens, b->words, b->out,
                      b->out_width, b->requested, row_slots, row_positions, write_rows) != 0)
        return -2;
    return 0;
}
