// cuda-emu: the NCCL calls ragged makes (libnccl.so.2), for ranks that live in one process:
// communicators made by ncclCommInitAll, or by ncclCommInitRank with the same unique id from
// several threads (a world of one included). Ranks in other processes cannot join (an
// ncclCommInitRank waiting for them fails after CUDA_EMU_NCCL_WAIT_S, default 120 s).
//
// Each call runs when every rank of the communicator has made its k-th collective call (a real
// NCCL call returns at once and completes on the stream); inputs are copied when posted, so
// in-place calls are safe. Rank contributions must agree in kind, count, type and root, as
// NCCL requires (a mismatch hangs or corrupts on a GPU; here it is ncclInvalidUsage with a
// message). Sums run in rank order (NCCL's ring order differs: results agree with a GPU to
// rounding), bf16 rounded after each addition and Avg as NCCL's (inputs times 1/n, then the
// sum), so they are not the CPU thread backend's bits; u8 sums wrap modulo 256, as NCCL's.
// Grouped ncclSend / ncclRecv (between ncclGroupStart and ncclGroupEnd) post every send, then
// take every receive, matched in order per pair of ranks.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bf16.h"

typedef int ncclResult_t;
enum : ncclResult_t {
    ncclSuccess = 0,
    ncclSystemError = 2,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
};
enum { ncclUint8 = 1, ncclFloat32 = 7, ncclBfloat16 = 9 };
enum { ncclSum = 0, ncclAvg = 4 };

extern "C" int cuda_emu_check_range(const char* call, unsigned long long ptr, size_t bytes);
extern "C" int cuda_emu_device_of(const void* ptr);
extern "C" int cuda_emu_current_device();

namespace {

using Bytes = std::shared_ptr<std::vector<char>>;

// One collective call of every rank: what each posted.
struct Round {
    std::string kind;
    size_t count = 0;
    int type = 0, op = 0, root = 0;
    std::vector<Bytes> data;
    int posted = 0, taken = 0;
};

// A sent message; `taken` once its receiver has copied it.
struct Message {
    Bytes data;
    bool taken = false;
};

struct World {
    int n = 0;
    std::mutex m;
    std::condition_variable cv;
    std::map<long, Round> rounds;                      // by collective sequence number
    std::map<std::pair<int, int>, std::deque<std::shared_ptr<Message>>> mail;  // (from, to)
    std::vector<int> devices;  // each rank's device (ncclCommInitRank)
    int joined = 0;
    bool aborted = false;
};

struct Comm {
    std::shared_ptr<World> world;
    int rank = 0, device = 0;
    long next_round = 0;
};

struct PointToPoint {
    bool send;
    char* buf;
    size_t bytes;
    int peer;
    Comm* comm;
};

std::mutex worlds_lock;
std::map<std::string, std::shared_ptr<World>> worlds_by_id;
thread_local int group_depth = 0;
thread_local std::vector<PointToPoint> grouped;

std::chrono::seconds wait_limit() {
    const char* s = getenv("CUDA_EMU_NCCL_WAIT_S");
    return std::chrono::seconds(s ? atoi(s) : 120);
}

ncclResult_t fail(ncclResult_t r, const char* call, const std::string& why) {
    fprintf(stderr, "cuda-emu: %s: %s\n", call, why.c_str());
    return r;
}

size_t type_bytes(int type) {
    switch (type) {
        case ncclFloat32: return 4;
        case ncclBfloat16: return 2;
        case ncclUint8: return 1;
        default: return 0;
    }
}

float load(const char* p, int type, size_t i) {
    if (type == ncclFloat32) {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    unsigned short h;
    memcpy(&h, p + 2 * i, 2);
    return bf16_to_f32(h);
}

void store(char* p, int type, size_t i, float v) {
    if (type == ncclFloat32) {
        memcpy(p + 4 * i, &v, 4);
        return;
    }
    const unsigned short h = f32_to_bf16(v);
    memcpy(p + 2 * i, &h, 2);
}

// x rounded to bf16 (and widened back) when `type` is bf16.
float f32_to_bf16_if(int type, float x) {
    return type == ncclBfloat16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

// dst[i] = op over ranks of the `count` elements at element `offset` of each posted buffer.
ncclResult_t reduce(const char* call, const std::vector<Bytes>& data, size_t offset, size_t count,
                    int type, int op, char* dst) {
    if (op != ncclSum && op != ncclAvg)
        return fail(ncclInvalidArgument, call, "ncclSum and ncclAvg only are emulated");
    if (type == ncclUint8) {  // NCCL's: in u8, modulo 256; Avg truncates
        for (size_t i = 0; i < count; ++i) {
            unsigned char acc = 0;
            for (const Bytes& d : data) acc = (unsigned char)(acc + (*d)[offset + i]);
            dst[i] = (char)(op == ncclAvg ? acc / data.size() : acc);
        }
        return ncclSuccess;
    }
    if (type != ncclFloat32 && type != ncclBfloat16)
        return fail(ncclInvalidArgument, call, "reductions of f32, bf16 and u8 only are emulated");
    // NCCL's float Avg: each input times 1/n (rounded to the type), then summed; a bf16 sum is
    // rounded to bf16 after every addition.
    const float scale = f32_to_bf16_if(type, 1.0f / (float)data.size());
    for (size_t i = 0; i < count; ++i) {
        float acc = 0.0f;
        for (size_t r = 0; r < data.size(); ++r) {
            float x = load(data[r]->data(), type, offset + i);
            if (op == ncclAvg) x = f32_to_bf16_if(type, x * scale);
            acc = r == 0 ? x : f32_to_bf16_if(type, acc + x);
        }
        store(dst, type, i, acc);
    }
    return ncclSuccess;
}

Bytes copy_of(const void* p, size_t bytes) {
    auto b = std::make_shared<std::vector<char>>(bytes);
    if (bytes) memcpy(b->data(), p, bytes);
    return b;
}

// Posts this rank's part of its next collective and returns every rank's, once all posted.
ncclResult_t meet(const char* call, Comm* c, const Round& mine, Bytes part,
                  std::vector<Bytes>* all) {
    World& w = *c->world;
    std::unique_lock<std::mutex> g(w.m);
    const long seq = c->next_round++;
    Round& r = w.rounds[seq];
    if (r.posted == 0) {
        r.kind = mine.kind, r.count = mine.count, r.type = mine.type, r.op = mine.op;
        r.root = mine.root;
        r.data.assign(w.n, nullptr);
    } else if (r.kind != mine.kind || r.count != mine.count || r.type != mine.type ||
               r.op != mine.op || r.root != mine.root) {
        char why[256];
        snprintf(why, sizeof why,
                 "rank %d calls %s(count %zu, type %d, op %d, root %d) where another rank "
                 "called %s(count %zu, type %d, op %d, root %d)",
                 c->rank, mine.kind.c_str(), mine.count, mine.type, mine.op, mine.root,
                 r.kind.c_str(), r.count, r.type, r.op, r.root);
        w.aborted = true;
        w.cv.notify_all();
        return fail(ncclInvalidUsage, call, why);
    }
    r.data[c->rank] = std::move(part);
    ++r.posted;
    w.cv.notify_all();
    const bool met = w.cv.wait_for(g, wait_limit(), [&] { return r.posted == w.n || w.aborted; });
    if (w.aborted) return fail(ncclRemoteError, call, "the communicator was aborted");
    if (!met) {
        return fail(ncclSystemError, call,
                    "rank " + std::to_string(c->rank) + " waited " +
                        std::to_string(wait_limit().count()) + " s for the other ranks");
    }
    *all = r.data;
    if (++r.taken == w.n) w.rounds.erase(seq);
    return ncclSuccess;
}

// The buffer lies in device memory of the communicator's device.
ncclResult_t check(const char* call, const Comm* c, const void* p, size_t bytes) {
    if (bytes == 0) return ncclSuccess;
    if (cuda_emu_check_range(call, (unsigned long long)p, bytes))
        return fail(ncclInvalidArgument, call, "a buffer outside device memory");
    if (cuda_emu_device_of(p) != c->device)
        return fail(ncclInvalidArgument, call,
                    "rank " + std::to_string(c->rank) + "'s buffer is on device " +
                        std::to_string(cuda_emu_device_of(p)) + ", its communicator on " +
                        std::to_string(c->device));
    return ncclSuccess;
}

// Posts a send; an ungrouped one (`wait`) returns once it is received, as NCCL's may block
// until the peer's receive is posted (so two ranks that each send, then receive, outside a
// group deadlock on a GPU and fail here).
ncclResult_t post_send(Comm* c, const char* buf, size_t bytes, int peer, bool wait) {
    World& w = *c->world;
    std::unique_lock<std::mutex> g(w.m);
    auto msg = std::make_shared<Message>();
    msg->data = copy_of(buf, bytes);
    w.mail[{c->rank, peer}].push_back(msg);
    w.cv.notify_all();
    if (wait && !w.cv.wait_for(g, wait_limit(), [&] { return msg->taken || w.aborted; }))
        return fail(ncclSystemError, "ncclSend",
                    "rank " + std::to_string(peer) + " posted no receive (a send outside a "
                    "group waits for it)");
    return w.aborted ? fail(ncclRemoteError, "ncclSend", "the communicator was aborted")
                     : ncclSuccess;
}

ncclResult_t take_recv(Comm* c, char* buf, size_t bytes, int peer) {
    World& w = *c->world;
    std::unique_lock<std::mutex> g(w.m);
    auto& box = w.mail[{peer, c->rank}];
    if (!w.cv.wait_for(g, wait_limit(), [&] { return !box.empty() || w.aborted; }))
        return fail(ncclSystemError, "ncclRecv", "no message from rank " + std::to_string(peer));
    if (w.aborted) return fail(ncclRemoteError, "ncclRecv", "the communicator was aborted");
    std::shared_ptr<Message> msg = box.front();
    box.pop_front();
    msg->taken = true;
    w.cv.notify_all();
    if (msg->data->size() != bytes) {
        return fail(ncclInvalidUsage, "ncclRecv",
                    "rank " + std::to_string(peer) + " sent " +
                        std::to_string(msg->data->size()) + " bytes, rank " +
                        std::to_string(c->rank) + " expects " + std::to_string(bytes));
    }
    if (bytes) memcpy(buf, msg->data->data(), bytes);
    return ncclSuccess;
}

ncclResult_t point_to_point(PointToPoint op, bool grouped) {
    return op.send ? post_send(op.comm, op.buf, op.bytes, op.peer, !grouped)
                   : take_recv(op.comm, op.buf, op.bytes, op.peer);
}

ncclResult_t queue_or_run(PointToPoint op) {
    const char* call = op.send ? "ncclSend" : "ncclRecv";
    if (op.peer < 0 || op.peer >= op.comm->world->n) return fail(ncclInvalidArgument, call, "peer");
    if (ncclResult_t r = check(call, op.comm, op.buf, op.bytes)) return r;
    if (group_depth > 0) {
        grouped.push_back(op);
        return ncclSuccess;
    }
    return point_to_point(op, false);
}

}  // namespace

extern "C" {

typedef struct {
    char internal[128];
} ncclUniqueId;

ncclResult_t ncclGetVersion(int* v) {
    *v = 22800;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    static std::mutex m;
    static unsigned long long counter = 0;
    std::lock_guard<std::mutex> g(m);
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "cuda-emu %d %lld %llu", (int)getpid(),
             (long long)time(nullptr), ++counter);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
    const char* call = "ncclCommInitRank";
    if (nranks < 1 || rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, call, "rank");
    std::shared_ptr<World> w;
    {
        std::lock_guard<std::mutex> g(worlds_lock);
        auto& slot = worlds_by_id[std::string(id.internal, sizeof id.internal)];
        if (!slot) {
            slot = std::make_shared<World>();
            slot->n = nranks;
            slot->devices.assign(nranks, -1);
        }
        w = slot;
    }
    if (w->n != nranks) return fail(ncclInvalidUsage, call, "ranks disagree on the world size");
    const int device = cuda_emu_current_device();
    std::unique_lock<std::mutex> g(w->m);
    w->devices[rank] = device;
    ++w->joined;
    w->cv.notify_all();
    if (!w->cv.wait_for(g, wait_limit(), [&] { return w->joined >= w->n; }))
        return fail(ncclSystemError, call,
                    "the other ranks did not join (cuda-emu joins ranks of one process only)");
    for (int r = 0; r < nranks; ++r)
        if (r != rank && w->devices[r] == device)
            return fail(ncclInvalidUsage, call,
                        "duplicate GPU: ranks " + std::to_string(rank) + " and " +
                            std::to_string(r) + " on device " + std::to_string(device));
    *comm = new Comm{w, rank, device, 0};
    return ncclSuccess;
}

ncclResult_t ncclCommInitAll(void** comms, int ndev, const int* devlist) {
    const char* call = "ncclCommInitAll";
    if (ndev < 1) return fail(ncclInvalidArgument, call, "ndev");
    for (int i = 0; i < ndev; ++i)
        for (int j = 0; j < i; ++j)
            if (devlist && devlist[i] == devlist[j])
                return fail(ncclInvalidUsage, call, "duplicate GPU in the device list");
    auto w = std::make_shared<World>();
    w->n = ndev;
    w->joined = ndev;
    for (int i = 0; i < ndev; ++i) comms[i] = new Comm{w, i, devlist ? devlist[i] : i, 0};
    return ncclSuccess;
}

// Every rank of `comm` calls it (a collective): ranks of one color form a new communicator,
// ranked by key, then by rank in `comm`; NCCL_SPLIT_NOCOLOR (-1) gets none. `config` is
// ignored (NCCL's defaults).
ncclResult_t ncclCommSplit(void* comm, int color, int key, void** newcomm, void*) {
    const char* call = "ncclCommSplit";
    Comm* c = (Comm*)comm;
    const long seq = c->next_round;
    const int mine_ck[2] = {color, key};
    Round mine{"ncclCommSplit", 2, 0, 0, 0, {}, 0, 0};
    std::vector<Bytes> all;
    if (ncclResult_t r = meet(call, c, mine, copy_of(mine_ck, sizeof mine_ck), &all)) return r;
    *newcomm = nullptr;
    if (color == -1) return ncclSuccess;
    std::vector<std::pair<std::pair<int, int>, int>> members;  // ((key, rank), rank)
    for (size_t q = 0; q < all.size(); ++q) {
        int ck[2];
        memcpy(ck, all[q]->data(), sizeof ck);
        if (ck[0] == color) members.push_back({{ck[1], (int)q}, (int)q});
    }
    std::sort(members.begin(), members.end());
    int rank = 0;
    while (members[rank].second != c->rank) ++rank;
    // One world per (communicator, split, color), made by the first of its ranks to get here.
    char name[128];
    snprintf(name, sizeof name, "split %p %ld %d", (void*)c->world.get(), seq, color);
    std::shared_ptr<World> w;
    {
        std::lock_guard<std::mutex> g(worlds_lock);
        auto& slot = worlds_by_id[std::string(name)];
        if (!slot) {
            slot = std::make_shared<World>();
            slot->n = (int)members.size();
            slot->joined = slot->n;
            slot->devices.assign(slot->n, -1);
        }
        w = slot;
        w->devices[rank] = c->device;
    }
    *newcomm = new Comm{w, rank, c->device, 0};
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(void* comm) {
    delete (Comm*)comm;
    return ncclSuccess;
}
ncclResult_t ncclCommFinalize(void*) { return ncclSuccess; }
ncclResult_t ncclCommAbort(void* comm) {
    Comm* c = (Comm*)comm;
    {
        std::lock_guard<std::mutex> g(c->world->m);
        c->world->aborted = true;
        c->world->cv.notify_all();
    }
    delete c;
    return ncclSuccess;
}
ncclResult_t ncclCommGetAsyncError(void* comm, ncclResult_t* state) {
    *state = ((Comm*)comm)->world->aborted ? ncclRemoteError : ncclSuccess;
    return ncclSuccess;
}
ncclResult_t ncclCommCount(void* comm, int* n) {
    *n = ((Comm*)comm)->world->n;
    return ncclSuccess;
}
ncclResult_t ncclCommUserRank(void* comm, int* r) {
    *r = ((Comm*)comm)->rank;
    return ncclSuccess;
}
ncclResult_t ncclCommCuDevice(void* comm, int* d) {
    *d = ((Comm*)comm)->device;
    return ncclSuccess;
}
const char* ncclGetErrorString(ncclResult_t r) {
    static thread_local char text[48];
    snprintf(text, sizeof text, "cuda-emu NCCL error %d", r);
    return text;
}
const char* ncclGetLastError(void*) { return "see the cuda-emu line on stderr"; }

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, int type, void* comm,
                           void*) {
    const char* call = "ncclAllGather";
    Comm* c = (Comm*)comm;
    const size_t b = type_bytes(type);
    if (!b) return fail(ncclInvalidArgument, call, "data type");
    if (group_depth) return fail(ncclInvalidUsage, call, "collectives in a group are not emulated");
    if (ncclResult_t r = check(call, c, send, count * b)) return r;
    if (ncclResult_t r = check(call, c, recv, count * b * c->world->n)) return r;
    Round mine{"ncclAllGather", count, type, 0, 0, {}, 0, 0};
    std::vector<Bytes> all;
    if (ncclResult_t r = meet(call, c, mine, copy_of(send, count * b), &all)) return r;
    for (size_t q = 0; q < all.size(); ++q)
        if (count) memcpy((char*)recv + q * count * b, all[q]->data(), count * b);
    return ncclSuccess;
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op,
                               void* comm, void*) {
    const char* call = "ncclReduceScatter";
    Comm* c = (Comm*)comm;
    const size_t b = type_bytes(type), n = c->world->n;
    if (!b) return fail(ncclInvalidArgument, call, "data type");
    if (group_depth) return fail(ncclInvalidUsage, call, "collectives in a group are not emulated");
    if (ncclResult_t r = check(call, c, send, count * b * n)) return r;
    if (ncclResult_t r = check(call, c, recv, count * b)) return r;
    Round mine{"ncclReduceScatter", count, type, op, 0, {}, 0, 0};
    std::vector<Bytes> all;
    if (ncclResult_t r = meet(call, c, mine, copy_of(send, count * b * n), &all)) return r;
    return reduce(call, all, c->rank * count, count, type, op, (char*)recv);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, int type, int op,
                           void* comm, void*) {
    const char* call = "ncclAllReduce";
    Comm* c = (Comm*)comm;
    const size_t b = type_bytes(type);
    if (!b) return fail(ncclInvalidArgument, call, "data type");
    if (group_depth) return fail(ncclInvalidUsage, call, "collectives in a group are not emulated");
    if (ncclResult_t r = check(call, c, send, count * b)) return r;
    if (ncclResult_t r = check(call, c, recv, count * b)) return r;
    Round mine{"ncclAllReduce", count, type, op, 0, {}, 0, 0};
    std::vector<Bytes> all;
    if (ncclResult_t r = meet(call, c, mine, copy_of(send, count * b), &all)) return r;
    return reduce(call, all, 0, count, type, op, (char*)recv);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, int type, int root,
                           void* comm, void*) {
    const char* call = "ncclBroadcast";
    Comm* c = (Comm*)comm;
    const size_t b = type_bytes(type);
    if (!b) return fail(ncclInvalidArgument, call, "data type");
    if (root < 0 || root >= c->world->n) return fail(ncclInvalidArgument, call, "root");
    if (group_depth) return fail(ncclInvalidUsage, call, "collectives in a group are not emulated");
    if (c->rank == root) {
        if (ncclResult_t r = check(call, c, send, count * b)) return r;
    }
    if (ncclResult_t r = check(call, c, recv, count * b)) return r;
    Round mine{"ncclBroadcast", count, type, 0, root, {}, 0, 0};
    std::vector<Bytes> all;
    Bytes part = c->rank == root ? copy_of(send, count * b) : std::make_shared<std::vector<char>>();
    if (ncclResult_t r = meet(call, c, mine, part, &all)) return r;
    if (count) memcpy(recv, all[root]->data(), count * b);
    return ncclSuccess;
}

ncclResult_t ncclSend(const void* send, size_t count, int type, int peer, void* comm, void*) {
    const size_t b = type_bytes(type);
    if (!b) return fail(ncclInvalidArgument, "ncclSend", "data type");
    return queue_or_run({true, (char*)send, count * b, peer, (Comm*)comm});
}

ncclResult_t ncclRecv(void* recv, size_t count, int type, int peer, void* comm, void*) {
    const size_t b = type_bytes(type);
    if (!b) return fail(ncclInvalidArgument, "ncclRecv", "data type");
    return queue_or_run({false, (char*)recv, count * b, peer, (Comm*)comm});
}

ncclResult_t ncclGroupStart() {
    ++group_depth;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd", "no group is open");
    if (--group_depth > 0) return ncclSuccess;
    std::vector<PointToPoint> ops;
    ops.swap(grouped);
    ncclResult_t first = ncclSuccess;
    for (bool sends : {true, false})
        for (const PointToPoint& op : ops)
            if (op.send == sends && first == ncclSuccess) first = point_to_point(op, true);
    return first;
}

}  // extern "C"
