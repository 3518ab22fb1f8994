package sweeper

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"
)

type capture struct{ objects []runtime.Object }

func (c *capture) Event(o runtime.Object, _, _, _ string) { c.objects = append(c.objects, o) }
func (c *capture) Eventf(o runtime.Object, _, _, _ string, _ ...interface{}) {
	c.objects = append(c.objects, o)
}
func (c *capture) AnnotatedEventf(o runtime.Object, _ map[string]string, _, _, _ string, _ ...interface{}) {
	c.objects = append(c.objects, o)
}

func TestKubeEvents(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	client := fake.NewSimpleClientset(
		&corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pvc-1", UID: "u-pv"}},
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: "u-node"}},
	)
	rec := &capture{}
	k := KubeEvents{Client: client, Recorder: rec, NodeName: "node-a"}
	k.Event(ctx, "pvc-1", EventTypeWarning, ReasonStaleStagingRemoved, "m")
	k.Event(ctx, "pvc-static", EventTypeWarning, ReasonStaleStagingRemoved, "m")
	if len(rec.objects) != 2 {
		t.Fatalf("got %d events", len(rec.objects))
	}
	if pv, ok := rec.objects[0].(*corev1.PersistentVolume); !ok || pv.UID != "u-pv" {
		t.Fatalf("first event on %#v", rec.objects[0])
	}
	if n, ok := rec.objects[1].(*corev1.Node); !ok || n.UID != "u-node" {
		t.Fatalf("second event on %#v", rec.objects[1])
	}
}
