package driver

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// crowdController is a controller whose hotplug never finishes on its own:
// KubeVirt is slow, and every call waits until its context ends.
func crowdController(t *testing.T, opts ControllerOptions, vols ...string) (*controllerService, func() int) {
	t.Helper()
	s, fv, hp := newTestController(opts)
	var mu sync.Mutex
	inQueue := 0
	block := func(ctx context.Context, _, _ string) error {
		mu.Lock()
		inQueue++
		mu.Unlock()
		<-ctx.Done()
		return ctx.Err()
	}
	hp.attach, hp.detach = block, block
	for _, v := range vols {
		fv.pvcs[v] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: v}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
		hp.holders[v] = []string{"vm1"}
	}
	return s, func() int { mu.Lock(); defer mu.Unlock(); return inQueue }
}

// crowdCalls runs publishes (and an unpublish of "c") against s, with
// callers that set no deadline, and records who answered what, in order.
type crowdCalls struct {
	ctx     context.Context
	s       *controllerService
	mu      sync.Mutex
	answers []crowdAnswer
}

type crowdAnswer struct {
	vol string
	err error
}

func (c *crowdCalls) call(vol string) {
	var err error
	if vol == "c" {
		_, err = c.s.ControllerUnpublishVolume(c.ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: "vm1"})
	} else {
		_, err = c.s.ControllerPublishVolume(c.ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm1", VolumeCapability: rwo})
	}
	c.mu.Lock()
	c.answers = append(c.answers, crowdAnswer{vol, err})
	c.mu.Unlock()
}

func (c *crowdCalls) answered() []crowdAnswer {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.answers)
}

// TestACrowdOfWaitingCallsAnswersInProgress: while PublishWaitCrowd
// publishes and unpublishes wait for the queue at once, those that have
// waited PublishWait answer "in progress" (DeadlineExceeded) instead of
// holding their callers' workers up to the deadline, until fewer than the
// crowd are left.
func TestACrowdOfWaitingCallsAnswersInProgress(t *testing.T) {
	const crowd = 3
	s, inQueue := crowdController(t, ControllerOptions{PublishWait: 20 * time.Millisecond, PublishWaitCrowd: crowd}, "a", "b", "c")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	c := &crowdCalls{ctx: ctx, s: s}
	go c.call("a")
	testwait.For(t, "the first publish in the queue", 10*time.Second, func() bool { return inQueue() == 1 })
	go c.call("b")
	go c.call("c")
	testwait.For(t, "an answer from the crowd", 30*time.Second, func() bool { return len(c.answered()) == 1 })
	if a := c.answered()[0]; status.Code(a.err) != codes.DeadlineExceeded {
		t.Errorf("%s: got %v, want DeadlineExceeded (in progress, retry)", a.vol, a.err)
	}
	if n, _ := s.waiting.state(); n != crowd-1 {
		t.Errorf("%d calls left waiting, want %d: one answer ends the crowd", n, crowd-1)
	}
	cancel()
	testwait.For(t, "every call answered once the callers gave up", 30*time.Second, func() bool { return len(c.answered()) == 3 })
	if n, _ := s.waiting.state(); n != 0 {
		t.Errorf("%d calls still counted as waiting after every call returned", n)
	}
}

// TestAFreedCallsRetryIsNotFreedAgain: the retry of a call the crowd freed
// makes the crowd again but waits for KubeVirt (its intent is queued, and
// another short answer would only double the caller's backoff): the other
// call is freed. With a wait this short both would be free to go, so each
// round would pick the retry half the time if it could.
func TestAFreedCallsRetryIsNotFreedAgain(t *testing.T) {
	for round := range 20 {
		s, inQueue := crowdController(t, ControllerOptions{PublishWait: time.Nanosecond, PublishWaitCrowd: 2}, "a", "b")
		ctx, cancel := context.WithCancel(context.Background())
		c := &crowdCalls{ctx: ctx, s: s}
		go c.call("a")
		testwait.For(t, "the first publish in the queue", 10*time.Second, func() bool { return inQueue() == 1 })
		go c.call("b")
		testwait.For(t, "an answer from the crowd", 30*time.Second, func() bool { return len(c.answered()) == 1 })
		freed := c.answered()[0].vol
		go c.call(freed)
		testwait.For(t, "an answer once the retry made the crowd again", 30*time.Second, func() bool { return len(c.answered()) == 2 })
		if a := c.answered()[1]; a.vol == freed || status.Code(a.err) != codes.DeadlineExceeded {
			t.Fatalf("round %d: %s answered %v after the retry of %s joined; want the other call freed", round, a.vol, a.err, freed)
		}
		cancel()
		testwait.For(t, "every call answered once the callers gave up", 30*time.Second, func() bool { return len(c.answered()) == 3 })
	}
}

// TestALoneCallWaitsForKubeVirt: below the crowd, a publish waits past
// PublishWait and is answered when the queue is done, so the caller gets
// its answer without a retry and the retry's backoff.
func TestALoneCallWaitsForKubeVirt(t *testing.T) {
	const wait = 20 * time.Millisecond
	s, _, hp := newTestController(ControllerOptions{PublishWait: wait, PublishWaitCrowd: 3})
	hp.attach = func(ctx context.Context, _, _ string) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(10 * wait):
			return nil // KubeVirt took longer than the publish wait
		}
	}
	s.volumes.(*fakeVolumes).pvcs["a"] = &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: "a"}, Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound}}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := s.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "a", NodeId: "vm1", VolumeCapability: rwo}); err != nil {
		t.Fatalf("a lone publish answered %v, want OK once KubeVirt is done", err)
	}
}
