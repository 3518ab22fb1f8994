package lab

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
)

func podOn(name, node, ownerKind string, phase corev1.PodPhase) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name)},
		Spec: corev1.PodSpec{NodeName: node}, Status: corev1.PodStatus{Phase: phase}}
	if ownerKind != "" {
		p.OwnerReferences = []metav1.OwnerReference{{Kind: ownerKind, Name: "owner", Controller: ptr.To(true)}}
	}
	return p
}

// A drain evicts what kubectl drain --ignore-daemonsets evicts on that
// node, asks again while an eviction is refused for now (429), and the
// evicted pods are awaited until gone.
func TestEvictNodeAsKubectlDrainDoes(t *testing.T) {
	mirror := podOn("static", "node-0", "Node", corev1.PodRunning)
	mirror.Annotations = map[string]string{corev1.MirrorPodAnnotationKey: "x"}
	kube := fake.NewClientset(
		podOn("db-0", "node-0", "StatefulSet", corev1.PodRunning),
		podOn("backup-1", "node-0", "Job", corev1.PodPending),
		podOn("plugin", "node-0", "DaemonSet", corev1.PodRunning),
		podOn("done", "node-0", "Job", corev1.PodSucceeded),
		mirror,
		podOn("db-1", "node-1", "StatefulSet", corev1.PodRunning),
	)
	var mu sync.Mutex
	var asked []string
	refused := map[string]bool{}
	kube.PrependReactor("create", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "eviction" {
			return false, nil, nil
		}
		ev := a.(k8stesting.CreateAction).GetObject().(*policyv1.Eviction)
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, ev.Name)
		if ev.Name == "db-0" && !refused[ev.Name] {
			refused[ev.Name] = true
			return true, nil, apierrors.NewTooManyRequests("Cannot evict pod as it would violate the pod's disruption budget.", 0)
		}
		return true, nil, kube.Tracker().Delete(schema.GroupVersionResource{Version: "v1", Resource: "pods"}, ev.Namespace, ev.Name)
	})
	ctx := context.Background()
	evicted, err := evictNode(ctx, kube, "node-0", time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(asked)
	if want := []string{"backup-1", "db-0", "db-0"}; !slices.Equal(asked, want) {
		t.Errorf("evictions asked %q, want %q", asked, want)
	}
	if want := []types.UID{"uid-db-0", "uid-backup-1"}; !slices.Equal(evicted, want) && !slices.Equal(evicted, []types.UID{"uid-backup-1", "uid-db-0"}) {
		t.Errorf("evicted %q, want %q", evicted, want)
	}
	if !awaitPodsGone(ctx, kube, "node-0", evicted, time.Millisecond, time.Second) {
		t.Error("the evicted pods are gone, but the wait says they are not")
	}
	if awaitPodsGone(ctx, kube, "node-0", []types.UID{"uid-plugin"}, time.Millisecond, 50*time.Millisecond) {
		t.Error("a pod still on the node was taken for gone")
	}
}
