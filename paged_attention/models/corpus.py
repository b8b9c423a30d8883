"""The prose the embedded tiny model's tokenizer is trained on (:mod:`.embedded`).

A few kilobytes of our own text, plain ASCII on purpose: the 253 learned byte-pair merges are then
all readable pieces of English words, which makes token ids easy to print in the notebooks.
Changing a byte of it changes the tokenizer, hence every token id the embedded model produces
(bump ``embedded._BUILD_VERSION`` if you do).
"""

CORPUS = """\
A language model writes one token at a time. To choose the next token it looks back at every token
before it, and this looking back is called attention. Each token is turned into a query, a key and
a value. The query of the newest token is compared with the keys of all the tokens that came before;
the scores become weights after a softmax, and the weighted sum of the values is the answer.

The keys and values of old tokens never change, so the model keeps them in memory instead of
computing them again at every step. This memory is the KV cache. It grows by one key and one value
per layer and per head for every token, and for a long conversation with many users it becomes the
largest thing on the GPU, larger than the model weights themselves.

The simple way to store the cache is to give every request one contiguous piece of memory, big
enough for the longest answer it could ever write. Most answers are short, so most of that memory
is reserved and never used. The holes between requests are wasted as well. This is fragmentation,
and it limits how many requests can run together.

An operating system solved the same problem long ago with virtual memory. A program sees one long
array, but the memory behind it is cut into small pages that can live anywhere. A page table maps
each logical page to a physical frame. PagedAttention does the same thing for the KV cache. The
cache is cut into blocks of sixteen tokens. Each sequence has a block table that maps its logical
blocks to physical blocks, and a new block is taken from the free list only when the last one is
full. At most one block per sequence is partly empty, so almost nothing is wasted.

Blocks can also be shared. When two samples start from the same prompt, their block tables point
to the same physical blocks, and a reference count says how many tables use each block. When one
of them writes into a shared block, the block is copied first: copy on write, exactly as a process
forks in Unix. Prefix caching goes one step further and finds blocks by a hash of their tokens, so a
system prompt that many users send is stored only once.

The attention kernel must now read keys and values through the block table. For each token in the
cache it computes the block number and the offset inside the block, loads the key from that slot,
and keeps a running maximum and a running sum so that the softmax can be done in one pass. The
result is the same as attention over a contiguous cache, to the last bit that the numbers allow.

A scheduler decides which requests run at each step. Continuous batching adds a new request as
soon as there is room and removes a finished one at once, instead of waiting for the whole batch.
When memory runs out, the scheduler preempts the request that arrived last: it frees its blocks and
later computes them again, or it swaps them out to the CPU and brings them back. Every request ends
with a reason: it wrote the stop token, it reached its length, or it was aborted.

The sampler turns the scores of the model into the next token. At temperature zero it takes the
most likely token, which is greedy decoding. With a higher temperature it draws at random, and top
p or top k keep only the likely tokens. A seed makes the draw repeat, so the same prompt with the
same seed gives the same answer, whatever else is in the batch.

Hello, my name is Ada and I live in a small town by the sea. The capital of France is Paris, the
capital of Italy is Rome, and the capital of Japan is Tokyo. What is the meaning of life? Write a
short story about a robot who learns to read. Once upon a time there was a little robot that
counted blocks all day: one, two, three, four, five, six, seven, eight, nine, ten. It kept a table
of every block it had, and it never lost one. The end.

In code, a block table is a list of integers, block_table[i] is the physical block of logical block
i, and the slot of token t is block_table[t // block_size] * block_size + t % block_size. The
numbers 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 appear often.
"""
