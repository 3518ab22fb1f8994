package host

import (
	"context"
	"reflect"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubefake "k8s.io/client-go/kubernetes/fake"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestClaimCacheShowsBoundClaimsOfItsNamespace(t *testing.T) {
	claim := func(ns, name string, phase corev1.PersistentVolumeClaimPhase) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns,
			Annotations:   map[string]string{"big": "x"},
			ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "kube-controller-manager"}}}, Status: corev1.PersistentVolumeClaimStatus{Phase: phase,
			Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}}}
	}
	kube := kubefake.NewClientset(
		claim("guests", "bound", corev1.ClaimBound),
		claim("guests", "pending", corev1.ClaimPending),
		claim("others", "elsewhere", corev1.ClaimBound),
	)
	cc := (&Client{Namespace: "guests", Kube: kube}).ClaimCache(0)
	if cc.ShowsBound("bound") {
		t.Fatal("an unsynced cache must not answer")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go cc.Run(ctx)
	testwait.For(t, "the cache to show the bound claim", 10*time.Second, func() bool { return cc.ShowsBound("bound") })
	for _, name := range []string{"pending", "elsewhere", "missing"} {
		if cc.ShowsBound(name) {
			t.Errorf("%s shown Bound", name)
		}
	}
	if err := kube.CoreV1().PersistentVolumeClaims("guests").Delete(ctx, "bound", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.For(t, "the deleted claim gone from the cache", 10*time.Second, func() bool { return !cc.ShowsBound("bound") })
	// The whole claim is kept but its managedFields: a reservation is
	// written back from it.
	objs := cc.inf.GetStore().List()
	for _, o := range objs {
		p := o.(*corev1.PersistentVolumeClaim)
		if len(p.ManagedFields) != 0 || p.Annotations["big"] != "x" {
			t.Errorf("cached claim %s: managedFields %v, annotations %v; want none and all", p.Name, p.ManagedFields, p.Annotations)
		}
		if want := (corev1.PersistentVolumeClaimStatus{Phase: p.Status.Phase}); !reflect.DeepEqual(p.Status, want) {
			t.Errorf("cached claim %s: status %+v, want only its phase", p.Name, p.Status)
		}
	}
	if len(objs) != 1 {
		t.Errorf("%d claims cached, want the one left in the namespace", len(objs))
	}
}
