package sweeper

import (
	"context"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

// KubeEvents publishes the sweeper's Events in the guest cluster: on the
// PersistentVolume named after the volume (volume IDs are host PVC names,
// which upstream and this driver take from the guest PV name), or on the
// guest Node when no such PV exists (a statically provisioned volume).
// Objects are read first because an Event without the object's UID does not
// show in `kubectl describe`.
type KubeEvents struct {
	Client   kubernetes.Interface
	Recorder record.EventRecorder
	// NodeName is the guest Kubernetes node this driver runs on.
	NodeName string
}

// Event implements EventRecorder.
func (k KubeEvents) Event(ctx context.Context, volumeID, eventType, reason, message string) {
	logger := klog.FromContext(ctx).WithValues("volume", volumeID)
	if pv, err := k.Client.CoreV1().PersistentVolumes().Get(ctx, volumeID, metav1.GetOptions{}); err == nil {
		k.Recorder.Event(pv, eventType, reason, message)
		return
	}
	node, err := k.Client.CoreV1().Nodes().Get(ctx, k.NodeName, metav1.GetOptions{})
	if err != nil {
		logger.Error(err, "no PV or node to attach the event to", "node", k.NodeName, "reason", reason)
		return
	}
	k.Recorder.Event(node, eventType, reason, message)
}

var _ EventRecorder = KubeEvents{}

// NewKubeEvents records through an event broadcaster writing to client, as
// the node plugin does in a guest pod; the broadcaster stops with ctx.
func NewKubeEvents(ctx context.Context, client kubernetes.Interface, nodeName, component string) KubeEvents {
	b := record.NewBroadcaster(record.WithContext(ctx))
	b.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: client.CoreV1().Events("")})
	rec := b.NewRecorder(scheme.Scheme, corev1.EventSource{Component: component, Host: nodeName})
	return KubeEvents{Client: client, Recorder: rec, NodeName: nodeName}
}
