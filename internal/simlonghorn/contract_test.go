package simlonghorn

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
)

func TestBadRequestsGetTheirCodes(t *testing.T) {
	l := newLab(t, Options{})
	l.createVolume(t, NewVolume{Name: "vol"})
	ctx := ctxFor(t)
	for _, tc := range []struct {
		name string
		req  *csi.ControllerPublishVolumeRequest
		want codes.Code
	}{
		{"no volume id", &csi.ControllerPublishVolumeRequest{NodeId: "host-a", VolumeCapability: rwo}, codes.InvalidArgument},
		{"no node id", &csi.ControllerPublishVolumeRequest{VolumeId: "vol", VolumeCapability: rwo}, codes.InvalidArgument},
		{"no capability", &csi.ControllerPublishVolumeRequest{VolumeId: "vol", NodeId: "host-a"}, codes.InvalidArgument},
		{"unknown node", &csi.ControllerPublishVolumeRequest{VolumeId: "vol", NodeId: "host-z", VolumeCapability: rwo}, codes.NotFound},
		{"unknown volume", &csi.ControllerPublishVolumeRequest{VolumeId: "nope", NodeId: "host-a", VolumeCapability: rwo}, codes.NotFound},
		{"RWX on an RWO volume", &csi.ControllerPublishVolumeRequest{VolumeId: "vol", NodeId: "host-a", VolumeCapability: rwx}, codes.Unimplemented},
	} {
		_, err := l.ctrl.ControllerPublishVolume(ctx, tc.req)
		if status.Code(err) != tc.want {
			t.Errorf("%s: got %v, want %v", tc.name, err, tc.want)
		}
	}
	// A volume already gone is unpublished, as the CSI spec asks.
	if err := l.unpublish(ctx, "nope", "host-a"); err != nil {
		t.Errorf("unpublish of a missing volume: %v", err)
	}
	if _, err := New(env.Config, Options{}); err == nil {
		t.Error("New without a scale: no error")
	}
}

// ControllerPublish returns once the ticket is satisfied and the engine
// runs there; ControllerUnpublish returns once the ticket is gone, before
// the engine has stopped.
func TestPublishWaitsForTheTicketAndUnpublishDoesNotWaitForTheDetach(t *testing.T) {
	l := newLab(t, Options{Faults: Faults{SlowDetach: 100}})
	l.createVolume(t, NewVolume{Name: "vol"})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwo); err != nil {
		t.Fatalf("publish: %v", err)
	}
	va, err := l.sim.store.getVA(ctx, "vol")
	if err != nil {
		t.Fatal(err)
	}
	ticket := AttachmentID("vol", "host-a")
	if !va.satisfied(ticket) {
		t.Fatalf("publish returned with ticket %s not satisfied: %+v", ticket, va.Status)
	}
	if v := l.volume(t, "vol"); v.Status.CurrentNodeID != "host-a" || v.Status.State != VolumeStateAttached {
		t.Fatalf("publish returned, volume %+v", v.Status)
	}
	if err := l.unpublish(ctx, "vol", "host-a"); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	// The detach takes 100 × 3 s × 0.05 = 15 s here; unpublish returned
	// after one poll of 0.1 s.
	if v := l.volume(t, "vol"); v.Status.CurrentNodeID != "host-a" {
		t.Fatalf("unpublish waited for the engine to stop: %+v", v.Status)
	}
	// Meanwhile a publish elsewhere times out (4.5 s here) without a
	// reason on its ticket: the volume is detaching, not attached elsewhere.
	if err := l.publish(ctx, "vol", "host-b", rwo); status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("publish on B while A detaches: got %v, want DeadlineExceeded", err)
	}
	if v := l.volume(t, "vol"); v.Status.State != VolumeStateDetaching || v.Status.CurrentNodeID != "host-a" {
		t.Fatalf("after B's publish timed out: %+v, want still detaching from host-a", v.Status)
	}
	if err := l.unpublish(ctx, "vol", "host-b"); err != nil {
		t.Fatalf("unpublish on B: %v", err)
	}
	until(t, "volume detached", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Status.State == VolumeStateDetached && v.Status.CurrentNodeID == "", fmt.Sprintf("%+v", v.Status)
	})
}

// An RWO volume attached on host-a is not attached on host-b until host-a
// let go: B's publish times out with the ticket's reason, and after A's
// unpublish the retry attaches it on B, through detached.
func TestRWOVolumeDetachesBeforeAttachingElsewhere(t *testing.T) {
	l := newLab(t, Options{})
	l.createVolume(t, NewVolume{Name: "vol"})
	ctx := ctxFor(t)
	seen := l.recordVolume(t, "vol")
	if err := l.publish(ctx, "vol", "host-a", rwo); err != nil {
		t.Fatalf("publish on A: %v", err)
	}
	err := l.publish(ctx, "vol", "host-b", rwo)
	if status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "currently attached to different node host-a") {
		t.Fatalf("publish on B while attached on A: got %v, want Internal naming host-a", err)
	}
	if err := l.unpublish(ctx, "vol", "host-a"); err != nil {
		t.Fatalf("unpublish on A: %v", err)
	}
	if err := l.publish(ctx, "vol", "host-b", rwo); err != nil {
		t.Fatalf("publish on B after A let go: %v", err)
	}
	var nodes []string
	for _, v := range seen() {
		if len(nodes) == 0 || nodes[len(nodes)-1] != v.Status.CurrentNodeID {
			nodes = append(nodes, v.Status.CurrentNodeID)
		}
	}
	if got := strings.Join(nodes, ","); !strings.Contains(got, "host-a,,host-b") || strings.Contains(got, "host-a,host-b") {
		t.Errorf("engine moved %q, want host-a, then none, then host-b", got)
	}
}

// A faulted volume is not ready: publish answers Aborted until it recovers;
// an attached volume that faults is detached and attached again for the
// ticket that is still there.
func TestFaultedVolumeIsAbortedThenRecovers(t *testing.T) {
	l := newLab(t, Options{Faults: Faults{Faulted: map[string]time.Duration{"vol": 40 * time.Second}}})
	l.createVolume(t, NewVolume{Name: "vol"})
	ctx := ctxFor(t)
	until(t, "volume faulted", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Status.Robustness == VolumeRobustnessFaulted, string(v.Status.Robustness)
	})
	err := l.publish(ctx, "vol", "host-a", rwo)
	if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), "not ready for workloads") {
		t.Fatalf("publish of a faulted volume: got %v, want Aborted", err)
	}
	until(t, "publish after the fault", func() (bool, string) {
		err := l.publish(ctx, "vol", "host-a", rwo)
		return err == nil, fmt.Sprint(err)
	})

	seen := l.recordVolume(t, "vol")
	l.sim.FaultVolume("vol", 20*time.Second)
	until(t, "re-attached on host-a after the fault", func() (bool, string) {
		var states []string
		detached := false
		for _, v := range seen() {
			states = append(states, string(v.Status.State)+"@"+v.Status.CurrentNodeID)
			detached = detached || v.Status.CurrentNodeID == ""
		}
		v := l.volume(t, "vol")
		return detached && v.Status.CurrentNodeID == "host-a" && v.Status.Robustness == VolumeRobustnessHealthy, strings.Join(states, " ")
	})
}

func migrate(t *testing.T, l *lab) context.Context {
	t.Helper()
	l.createVolume(t, NewVolume{Name: "vol", Migratable: true})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwx); err != nil {
		t.Fatalf("publish on A: %v", err)
	}
	if err := l.publish(ctx, "vol", "host-b", rwx); err != nil {
		t.Fatalf("publish on B (migration target): %v", err)
	}
	v := l.volume(t, "vol")
	if v.Spec.NodeID != "host-a" || v.Spec.MigrationNodeID != "host-b" || v.Status.CurrentMigrationNodeID != "host-b" {
		t.Fatalf("after publish on B: spec %+v status %+v, want attached on A migrating to B", v.Spec, v.Status)
	}
	return ctx
}

// A migration is confirmed only once A's ticket is gone.
func TestMigrationIsConfirmedWhenTheOldTicketGoes(t *testing.T) {
	l := newLab(t, Options{})
	ctx := migrate(t, l)
	// Confirmation does not come on its own while A's ticket is there:
	// several reconcile periods pass with the volume still on A.
	for range 3 {
		l.sim.reconcileAll(ctx)
	}
	if v := l.volume(t, "vol"); v.Spec.NodeID != "host-a" || v.Status.CurrentNodeID != "host-a" {
		t.Fatalf("confirmed with A's ticket still there: %+v %+v", v.Spec, v.Status)
	}
	if err := l.unpublish(ctx, "vol", "host-a"); err != nil {
		t.Fatalf("unpublish on A: %v", err)
	}
	until(t, "migration confirmed", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Spec.NodeID == "host-b" && v.Status.CurrentNodeID == "host-b" && !isMigrating(v), fmt.Sprintf("%+v %+v", v.Spec, v.Status)
	})
}

// When A's ticket goes while B's migration engine is still starting, the
// pass that finds the engine ready also confirms the migration. Every stored
// version of the volume must still be one longhorn-manager writes: its
// VolumeAttachment controller confirms only from a stored
// status.currentMigrationNodeID (v1.10.1
// controller/volume_attachment_controller.go:293,427-477) and writes the spec
// alone (:308-312), so spec.nodeID never names a node that neither the
// engine nor the migration engine of the stored status runs on.
func TestMigrationConfirmedWithTheEngineReadyStoresTheEngineFirst(t *testing.T) {
	// Slower than the other tests: A's ticket must be gone well before B's
	// migration engine is ready (2 s here).
	l := newLab(t, Options{Scale: 0.2})
	l.createVolume(t, NewVolume{Name: "vol", Migratable: true})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwx); err != nil {
		t.Fatalf("publish on A: %v", err)
	}
	seen := l.recordVolume(t, "vol")
	published := make(chan error, 1)
	go func() { published <- l.publish(ctx, "vol", "host-b", rwx) }()
	until(t, "migration to host-b started", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Spec.MigrationNodeID == "host-b", fmt.Sprintf("%+v", v.Spec)
	})
	if err := l.unpublish(ctx, "vol", "host-a"); err != nil {
		t.Fatalf("unpublish on A: %v", err)
	}
	if v := l.volume(t, "vol"); v.Status.CurrentMigrationNodeID != "" {
		t.Fatalf("migration engine ready before A's ticket went (%+v): the test needs the other order", v.Status)
	}
	if err := <-published; err != nil {
		t.Fatalf("publish on B: %v", err)
	}
	until(t, "migration confirmed", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Status.CurrentNodeID == "host-b" && !isMigrating(v), fmt.Sprintf("%+v %+v", v.Spec, v.Status)
	})
	for _, v := range seen() {
		n, st := v.Spec.NodeID, v.Status
		if n != "" && st.CurrentNodeID != "" && n != st.CurrentNodeID && st.CurrentMigrationNodeID != n {
			t.Errorf("stored volume (resourceVersion %s) has spec %+v with status %+v: spec.nodeID %s runs no engine",
				v.ResourceVersion, v.Spec, st, n)
		}
	}
}

// A migration is rolled back when B's ticket goes: the volume stays on A.
func TestMigrationRollsBackWhenTheNewTicketGoes(t *testing.T) {
	l := newLab(t, Options{})
	ctx := migrate(t, l)
	if err := l.unpublish(ctx, "vol", "host-b"); err != nil {
		t.Fatalf("unpublish on B: %v", err)
	}
	until(t, "migration rolled back", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Spec.NodeID == "host-a" && v.Status.CurrentNodeID == "host-a" && !isMigrating(v), fmt.Sprintf("%+v %+v", v.Spec, v.Status)
	})
}

func (l *lab) pod(t *testing.T, name, claim string, phase corev1.PodPhase) {
	t.Helper()
	ctx := ctxFor(t)
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: l.ns},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "c", Image: "hotplug-disk"}},
			Volumes: []corev1.Volume{{Name: "d", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			}}},
		},
	}
	created, err := l.kube.CoreV1().Pods(l.ns).Create(ctx, p, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if phase != corev1.PodPending {
		created.Status.Phase = phase
		if _, err := l.kube.CoreV1().Pods(l.ns).UpdateStatus(ctx, created, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

func (l *lab) workloads(t *testing.T, want string) {
	t.Helper()
	until(t, "workloads list "+want, func() (bool, string) {
		var got []string
		for _, w := range l.volume(t, "vol").Status.KubernetesStatus.WorkloadsStatus {
			got = append(got, w.PodName+"="+w.PodStatus)
		}
		return strings.Join(got, ",") == want, strings.Join(got, ",")
	})
}

// NodePublish needs a Pending pod in the workloads list, or only Running
// ones. The list keeps a finished pod after the pod is gone and follows a
// new pod only after the PV controller's lag, so the kubelet's first
// attempts can be refused.
func TestNodePublishChecksTheWorkloadsList(t *testing.T) {
	// A lag of 60 s (3 s here) leaves the list behind the new pod for long
	// enough that the first node publish sees the old list.
	l := newLab(t, Options{WorkloadsLag: 60 * time.Second})
	l.createVolume(t, NewVolume{Name: "vol", PVName: "pv-1", PVCNamespace: l.ns, PVCName: "claim"})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwo); err != nil {
		t.Fatalf("publish: %v", err)
	}
	if err := l.nodePublish(ctx, "vol", "host-b"); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("node publish on a node the volume is not attached to: got %v, want InvalidArgument", err)
	}
	l.pod(t, "old", "claim", corev1.PodFailed)
	l.workloads(t, "old=Failed")
	if err := l.kube.CoreV1().Pods(l.ns).Delete(ctx, "old", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// With no pod using the claim, the list keeps what it had.
	until(t, "lastPodRefAt set", func() (bool, string) {
		ks := l.volume(t, "vol").Status.KubernetesStatus
		return ks.LastPodRefAt != "", fmt.Sprintf("%+v", ks)
	})
	err := l.nodePublish(ctx, "vol", "host-a")
	if status.Code(err) != codes.Aborted || !strings.Contains(err.Error(), "no Pending workload pods") {
		t.Fatalf("node publish with only a finished pod listed: got %v, want Aborted", err)
	}
	l.pod(t, "new", "claim", corev1.PodPending)
	if err := l.nodePublish(ctx, "vol", "host-a"); status.Code(err) != codes.Aborted {
		t.Fatalf("node publish before the list followed the new pod: got %v, want Aborted", err)
	}
	until(t, "node publish once the list has the new pod", func() (bool, string) {
		err := l.nodePublish(ctx, "vol", "host-a")
		return err == nil, fmt.Sprint(err)
	})
	l.workloads(t, "new=Pending")
}

// A ghost entry (a pod long gone, still listed) refuses NodePublish: while
// it is there the list does not follow the pod that uses the volume (a list
// with the ghost is one the PV controller has not rebuilt), so no Pending
// pod is listed; once it goes the list catches up and the publish passes.
func TestGhostWorkloadRefusesNodePublish(t *testing.T) {
	ghost := WorkloadStatus{PodName: "hp-volume-gone", PodStatus: string(corev1.PodSucceeded)}
	l := newLab(t, Options{Faults: Faults{GhostWorkloads: map[string]WorkloadStatus{"vol": ghost}}})
	l.createVolume(t, NewVolume{Name: "vol", PVName: "pv-1", PVCNamespace: l.ns, PVCName: "claim"})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwo); err != nil {
		t.Fatalf("publish: %v", err)
	}
	l.pod(t, "running", "claim", corev1.PodRunning)
	l.workloads(t, "hp-volume-gone=Succeeded")
	if err := l.nodePublish(ctx, "vol", "host-a"); status.Code(err) != codes.Aborted {
		t.Fatalf("node publish with a ghost entry: got %v, want Aborted", err)
	}
	l.sim.SetGhostWorkload("vol", WorkloadStatus{})
	l.workloads(t, "running=Running")
	if err := l.nodePublish(ctx, "vol", "host-a"); err != nil {
		t.Fatalf("node publish without the ghost: %v", err)
	}
}

// A migratable volume that lost its engine during a migration is attached
// nowhere while both nodes hold tickets, and on the remaining node once one
// goes (volume_attachment_controller.go:684-697).
func TestInterruptedMigrationWaitsForOneTicket(t *testing.T) {
	l := newLab(t, Options{})
	ctx := migrate(t, l)
	l.sim.FaultVolume("vol", 20*time.Second)
	until(t, "volume faulted, then recovered and detached", func() (bool, string) {
		v := l.volume(t, "vol")
		return !l.sim.isFaulted("vol", time.Now()) && v.Status.Robustness == VolumeRobustnessUnknown &&
			v.Status.State == VolumeStateDetached, fmt.Sprintf("%+v", v.Status)
	})
	for range 3 {
		l.sim.reconcileAll(ctx)
	}
	if v := l.volume(t, "vol"); v.Spec.NodeID != "" || v.Status.CurrentNodeID != "" {
		t.Fatalf("attached with tickets on both nodes: %+v %+v", v.Spec, v.Status)
	}
	if err := l.unpublish(ctx, "vol", "host-b"); err != nil {
		t.Fatalf("unpublish on B: %v", err)
	}
	until(t, "attached on host-a", func() (bool, string) {
		v := l.volume(t, "vol")
		return v.Status.CurrentNodeID == "host-a" && v.Status.State == VolumeStateAttached, fmt.Sprintf("%+v", v.Status)
	})
}

// The stand-in follows its objects through watches, as longhorn-manager's
// informers do: a volume's attach takes several passes and no list beyond
// the informers' first ones (one each of volumes, VolumeAttachments, pods).
func TestPassesReadTheInformersNotTheServer(t *testing.T) {
	if env == nil {
		t.Skip("needs the API server (not in -short mode)")
	}
	var lists atomic.Int64
	cfg := rest.CopyConfig(env.Config)
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return listCounter{rt: rt, n: &lists} }
	l := newLabWith(t, Options{}, cfg)
	l.createVolume(t, NewVolume{Name: "vol"})
	ctx := ctxFor(t)
	if err := l.publish(ctx, "vol", "host-a", rwo); err != nil {
		t.Fatal(err)
	}
	if v := l.volume(t, "vol"); v.Status.CurrentNodeID != "host-a" {
		t.Fatalf("published but not attached on host-a: %+v", v.Status)
	}
	// Twice the informers' lists leaves room for a relist after a watch
	// error; a pass that lists would make dozens during the attach.
	if n := lists.Load(); n > 6 {
		t.Errorf("the stand-in listed %d times for one attach, want only its informers' first lists", n)
	}
}

// listCounter counts list requests (not watches) of Longhorn objects and
// pods.
type listCounter struct {
	rt http.RoundTripper
	n  *atomic.Int64
}

func (c listCounter) RoundTrip(req *http.Request) (*http.Response, error) {
	p := req.URL.Path
	if req.Method == http.MethodGet && req.URL.Query().Get("watch") != "true" &&
		(strings.HasSuffix(p, "/volumes") || strings.HasSuffix(p, "/volumeattachments") || strings.HasSuffix(p, "/pods")) {
		c.n.Add(1)
	}
	return c.rt.RoundTrip(req)
}
