package guest

import (
	"context"
	"os"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// Recorder writes the controller's Events in the guest cluster, on Nodes
// (a forced unplug, a fenced Node) and on VolumeAttachments (what a publish
// waits for), through one broadcaster: client-go's correlator aggregates
// repeats into one Event with a count and rate-limits them per object, as
// every Kubernetes component's Events are. The identity needs "create" and
// "patch" on events.
type Recorder struct {
	broadcaster record.EventBroadcaster
	recorder    record.EventRecorder
}

// NewRecorder starts recording as component, this replica named instance
// (default: the hostname, the pod's name); Stop ends it.
func NewRecorder(client kubernetes.Interface, component, instance string) *Recorder {
	if instance == "" {
		instance, _ = os.Hostname()
	}
	b := record.NewBroadcaster()
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	return &Recorder{broadcaster: b, recorder: b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: component, Host: instance})}
}

// Stop flushes and stops the recorder.
func (r *Recorder) Stop() { r.broadcaster.Shutdown() }

// NodeEvent implements EventSink. The Event lands in the default namespace,
// where kubelet's are and `kubectl describe node` looks. Failures are
// logged by the broadcaster: the Event reports a decision already taken.
func (r *Recorder) NodeEvent(_ context.Context, node *corev1.Node, eventType, reason, message string) {
	r.recorder.Event(node, eventType, reason, message)
}
