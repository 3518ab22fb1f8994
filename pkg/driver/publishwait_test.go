package driver

import (
	"context"
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

// TestACrowdOfWaitingCallsAnswersInProgress: while PublishWaitCrowd
// publishes and unpublishes wait for the queue at once, those that have
// waited PublishWait answer "in progress" (DeadlineExceeded) instead of
// holding their callers' workers up to the deadline, until fewer than the
// crowd are left; a newcomer that makes the crowd again frees one more.
func TestACrowdOfWaitingCallsAnswersInProgress(t *testing.T) {
	const crowd = 3
	s, inQueue := crowdController(t, ControllerOptions{PublishWait: 20 * time.Millisecond, PublishWaitCrowd: crowd}, "a", "b", "c", "d")
	// The callers set no deadline: any answer is the driver's choice.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var answers []error
	answered := func() int { mu.Lock(); defer mu.Unlock(); return len(answers) }
	answer := func(err error) { mu.Lock(); answers = append(answers, err); mu.Unlock() }
	publish := func(vol string) {
		_, err := s.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: "vm1", VolumeCapability: rwo})
		answer(err)
	}
	go publish("a")
	testwait.For(t, "the first publish in the queue", 10*time.Second, func() bool { return inQueue() == 1 })
	go publish("b")
	go func() {
		_, err := s.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: "c", NodeId: "vm1"})
		answer(err)
	}()
	testwait.For(t, "an answer from the crowd", 30*time.Second, func() bool { return answered() == 1 })
	if n, _ := s.waiting.state(); n != crowd-1 {
		t.Errorf("%d calls left waiting, want %d: one answer ends the crowd", n, crowd-1)
	}
	go publish("d")
	testwait.For(t, "an answer once the newcomer made the crowd again", 30*time.Second, func() bool { return answered() == 2 })
	mu.Lock()
	for _, err := range answers {
		if status.Code(err) != codes.DeadlineExceeded {
			t.Errorf("got %v, want DeadlineExceeded (in progress, retry)", err)
		}
	}
	mu.Unlock()
	cancel()
	testwait.For(t, "every call answered once the callers gave up", 30*time.Second, func() bool { return answered() == 4 })
	if n, _ := s.waiting.state(); n != 0 {
		t.Errorf("%d calls still counted as waiting after every call returned", n)
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
