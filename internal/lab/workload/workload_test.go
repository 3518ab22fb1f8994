package workload

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func boundClaim(size string) *corev1.PersistentVolumeClaim {
	q := resource.MustParse(size)
	return &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "lab-00", Name: dbClaim},
		Spec:       corev1.PersistentVolumeClaimSpec{Resources: corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: q}}},
		Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound, Capacity: corev1.ResourceList{corev1.ResourceStorage: q}},
	}
}

var dbPod = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "lab-00", Name: "db-0"}, Spec: corev1.PodSpec{NodeName: "node-1"}}

// An expansion asks for ExpandStep more and is done only when the claim
// reports the new size with nothing pending: the kubelet's part (the
// filesystem) counts, not just the resizer's.
func TestExpansionWaitsForTheFilesystem(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	kube := fake.NewClientset(boundClaim("1Gi"))
	var gets atomic.Int64
	kube.PrependReactor("get", "persistentvolumeclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		gets.Add(1)
		return false, nil, nil
	})
	w := New(kube, Options{Namespaces: 1, ExpandStep: resource.MustParse("512Mi"), ExpandTimeout: time.Minute})
	type result struct {
		e  Expansion
		ok bool
	}
	done := make(chan result, 1)
	go func() {
		e, ok := w.expand(ctx, "lab-00", dbPod)
		done <- result{e, ok}
	}()
	pvcs := kube.CoreV1().PersistentVolumeClaims("lab-00")
	var pvc *corev1.PersistentVolumeClaim
	if err := wait.PollUntilContextCancel(ctx, 10*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		var err error
		pvc, err = pvcs.Get(ctx, dbClaim, metav1.GetOptions{})
		q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
		return err == nil && q.Cmp(resource.MustParse("1536Mi")) == 0, nil
	}); err != nil {
		t.Fatalf("the claim's request never grew by 512Mi: %v", err)
	}
	// The resizer's part: capacity grown, the filesystem's resize pending.
	pvc.Status.Capacity[corev1.ResourceStorage] = resource.MustParse("1536Mi")
	pvc.Status.Conditions = []corev1.PersistentVolumeClaimCondition{{Type: corev1.PersistentVolumeClaimFileSystemResizePending, Status: corev1.ConditionTrue}}
	pvc.Status.AllocatedResourceStatuses = map[corev1.ResourceName]corev1.ClaimResourceStatus{corev1.ResourceStorage: corev1.PersistentVolumeClaimNodeResizePending}
	if pvc, err := pvcs.UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	} else {
		// Two more reads of the claim by the expansion: it has seen the
		// pending resize at least once.
		seen := gets.Load() + 2
		if err := wait.PollUntilContextCancel(ctx, 10*time.Millisecond, true, func(context.Context) (bool, error) {
			select {
			case r := <-done:
				t.Fatalf("the expansion ended while the filesystem's resize was pending: %+v", r)
			default:
			}
			return gets.Load() >= seen, nil
		}); err != nil {
			t.Fatal(err)
		}
		// The kubelet's part: the filesystem grew.
		pvc.Status.Conditions, pvc.Status.AllocatedResourceStatuses = nil, nil
		if _, err := pvcs.UpdateStatus(ctx, pvc, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	r := <-done
	if !r.ok || r.e.Err != nil || r.e.Done.IsZero() || r.e.Node != "node-1" || r.e.To.String() != "1536Mi" {
		t.Errorf("expansion = %+v, ok %v; want done to 1536Mi on node-1", r.e, r.ok)
	}
}

// An expansion that does not finish within ExpandTimeout ends with an error
// saying where the claim stands, for the lab's stuck report.
func TestExpansionNotDoneIsReported(t *testing.T) {
	ctx := context.Background()
	kube := fake.NewClientset(boundClaim("1Gi"))
	w := New(kube, Options{Namespaces: 1, ExpandStep: resource.MustParse("512Mi"), ExpandTimeout: 1500 * time.Millisecond})
	e, ok := w.expand(ctx, "lab-00", dbPod)
	if !ok || e.Err == nil || !strings.Contains(e.Err.Error(), "capacity 1Gi") {
		t.Errorf("expansion = %+v, ok %v; want an error naming the capacity reached", e, ok)
	}
	// A claim whose last expansion is still going on is left alone.
	if _, ok := w.expand(ctx, "lab-00", dbPod); ok {
		t.Error("a second expansion started while the first was not done")
	}
}
