# The C core without Python: libtpcore.a and the C tests.
#   make                 build/libtpcore.a and build/test_comm
#   make SANITIZE=1      the same under ASan + UBSan (in build-san/)
#   make test            run the C tests (world sizes 1-4)
CC ?= cc
CFLAGS_BASE := -std=c11 -Wall -Wextra -Wno-unused-parameter -fPIC -D_GNU_SOURCE -Icsrc/include
ifeq ($(SANITIZE),1)
BUILD ?= build-san
CFLAGS := $(CFLAGS_BASE) -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
LDFLAGS := -fsanitize=address,undefined
else
BUILD ?= build
CFLAGS := $(CFLAGS_BASE) -O3 -g
LDFLAGS :=
endif
LIBS := -lpthread -lrt -lm

CORE_SRC := $(wildcard csrc/core/*.c) $(wildcard csrc/comm/*.c) $(wildcard csrc/kernels/cpu/*.c) $(wildcard csrc/layers/*.c)
CORE_OBJ := $(patsubst csrc/%.c,$(BUILD)/obj/%.o,$(CORE_SRC))
HDRS := $(wildcard csrc/include/tpcore/*.h) $(wildcard csrc/*/*.h)

all: $(BUILD)/libtpcore.a $(BUILD)/test_comm

$(BUILD)/obj/%.o: csrc/%.c $(HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(BUILD)/libtpcore.a: $(CORE_OBJ)
	ar rcs $@ $^

$(BUILD)/test_comm: csrc/tests/test_comm.c $(BUILD)/libtpcore.a
	$(CC) $(CFLAGS) $< -o $@ $(BUILD)/libtpcore.a $(LDFLAGS) $(LIBS)

test: all
	./$(BUILD)/test_comm

clean:
	rm -rf build build-san

.PHONY: all test clean
